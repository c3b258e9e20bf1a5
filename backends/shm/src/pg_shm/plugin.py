"""pg-shm's entry point: what the registry reads without importing the backend.

Declared in ``pyproject.toml`` as ``[project.entry-points."pg_core.backends"] shm =
"pg_shm.plugin"``. Capabilities: every op of the contract, every dtype, per dtype every
reduce op the core's defaults allow (the shared-memory collectives fold with the same torch
ops); tags are the contract's whole range (a header carries a signed 64-bit tag); a receive
of the wrong size or dtype is refused (the header carries both); sends of at most
:data:`pg_shm.rings.EAGER_LIMIT` bytes (1 MiB) never wait for their receiver, larger ones
stream through the ring as the receiver takes them.
"""

from __future__ import annotations

import pluggy
from pg_core.backend import DTYPES, BackendSpec, Capabilities, default_reduce_ops
from pg_core.ops import OPS

from .segment import why_unsupported

__all__ = ["CAPABILITIES", "EAGER_LIMIT", "PRIORITY", "is_available", "pg_core_backends"]

hookimpl = pluggy.HookimplMarker("pg_core")

#: Kept equal to :data:`pg_shm.rings.EAGER_LIMIT` (a test checks it) so that listing backends
#: imports nothing but this module and :mod:`pg_shm.segment`.
EAGER_LIMIT = 1 << 20

#: Above pg-tcp's 10, so ``backends=None`` picks pg-shm for cpu. Whether a group's members share
#: a host is known only when its backend forms: pg-shm then refuses members on several hosts
#: alike, and the core falls back to the next default (pg-tcp) on every member together
#: (:class:`pg_core.dispatch.Dispatcher`; docs/decisions.md, "The default picks pg-shm").
PRIORITY = 20

CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES),
    reduce_ops={dtype: default_reduce_ops(dtype) for dtype in DTYPES},
    checks_message_size=True,
    eager_limit_bytes=EAGER_LIMIT,
)


def is_available() -> str | None:
    """``None``, or why this process cannot use shared memory (not Linux x86-64, no writable
    /dev/shm). Whether a group's members share a host is known only when it forms."""
    return why_unsupported()


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    """The ``shm`` backend: cpu tensors of the ranks of one host."""
    return [
        BackendSpec(
            name="shm",
            factory="pg_shm.backend:ShmBackend",
            devices=("cpu",),
            capabilities=CAPABILITIES,
            priority=PRIORITY,
            api_version="1.10",  # eager_limit_bytes (1.10); send_bytes with a list of parts (1.1)
            is_available=is_available,
            description="shared memory between the ranks of one host: pure Python and torch, futex waits",
        )
    ]
