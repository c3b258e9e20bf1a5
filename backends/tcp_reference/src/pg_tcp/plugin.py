"""pg-tcp's entry point: what the registry reads without importing the backend.

Declared in ``pyproject.toml`` as ``[project.entry-points."pg_core.backends"] tcp =
"pg_tcp.plugin"``. The factory is a ``"module:attr"`` string, so listing backends
imports neither :mod:`pg_tcp.backend` nor :mod:`pg_tcp.transport`.
"""

from __future__ import annotations

import pluggy
from pg_core.backend import DTYPES, BackendSpec, Capabilities, default_reduce_ops
from pg_core.ops import OPS, OPTIONAL_OPS

__all__ = ["CAPABILITIES", "pg_core_backends"]

hookimpl = pluggy.HookimplMarker("pg_core")

#: Every op (the optional receive from any source too), every dtype, and per dtype the
#: reduce ops that make sense for it.
CAPABILITIES = Capabilities(
    ops=frozenset(OPS + OPTIONAL_OPS),
    dtypes=frozenset(DTYPES),
    reduce_ops={dtype: default_reduce_ops(dtype) for dtype in DTYPES},
)


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    """The ``tcp`` backend: cpu tensors, priority 10 (the default when nothing faster is installed)."""
    return [
        BackendSpec(
            name="tcp",
            factory="pg_tcp.backend:TCPBackend",
            devices=("cpu",),
            capabilities=CAPABILITIES,
            priority=10,
            api_version="1.4",  # recv_anysource (1.4); send_bytes with a list of parts (1.1); it does not launch
            description="pure Python over TCP sockets: the reference backend, no dependencies beyond pg-core",
        )
    ]
