"""The ``pg_core.backends`` entry point: describes the backend without importing it."""

from __future__ import annotations

from pg_core.backend import DTYPES, BackendSpec, Capabilities

__all__ = ["pg_core_backends"]


def pg_core_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="storecomm",
            factory="pg_storecomm.backend:StoreBackend",  # imported on first use only
            devices=("cpu",),
            # Bytes are bytes: every dtype travels; every collective comes from pg_core.algorithms.
            capabilities=Capabilities(dtypes=frozenset(DTYPES)),
            priority=1,  # below pg-tcp's 10: used only when asked for by name
            description="messages through the group's key-value store (example plugin; slow)",
        )
    ]
