"""pg-tcp's entry point: what the registry reads without importing the backend.

Declared in ``pyproject.toml`` as ``[project.entry-points."pg_core.backends"] tcp =
"pg_tcp.plugin"``. The factory is a ``"module:attr"`` string, so listing backends
imports neither :mod:`pg_tcp.backend` nor :mod:`pg_tcp.transport`.

``eager_limit_bytes`` stays ``None`` (API 1.10: no limit): a send does not wait for its receiver
to post the matching receive. The sender writes the whole frame to the peer's socket from the
tensor's memory, and what the kernel does not take at once is written by this rank's waiting
threads; on the receiving side, any thread of the peer that is inside pg-tcp (a receive from
anyone, a collective, an asynchronous operation's progress thread) reads every arriving frame,
into a posted receive or a buffer of its own. What this does not cover: a peer that makes no
pg-tcp call at all while the message is larger than the two kernels' socket buffers can hold.
Then the send waits until the peer next enters pg-tcp, not for its matching receive. Measured
here (Linux loopback, default socket buffers): 1 MiB goes through while the peer waits outside
pg-tcp; 8 MiB waits for it. The conformance suite's ``eager_limit`` test checks sizes up to
1 MiB for a backend without a limit.
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
            api_version="1.4",  # recv_anysource (1.4); launched collectives (1.2); send_bytes with a list of parts (1.1)
            description="pure Python over TCP sockets: the reference backend, no dependencies beyond pg-core",
        )
    ]
