"""pg-tcp's entry point: what the registry reads without importing the backend.

Declared in ``pyproject.toml`` as ``[project.entry-points."pg_core.backends"] tcp =
"pg_tcp.plugin"``. The factory is a ``"module:attr"`` string, so listing backends
imports neither :mod:`pg_tcp.backend` nor :mod:`pg_tcp.transport`.

``eager_limit_bytes`` is ``None`` (API 1.10: no limit): a blocking ``send``/``send_bytes`` of
any size returns without waiting for its receiver to post the matching receive, or to make
any pg-tcp call at all. It writes from the caller's memory while the receiver's socket takes
bytes; once the socket has taken nothing for 5 ms (the receiver is not reading), the part not
written yet is copied and the send returns, the transport's drain thread finishing the frame
(see :mod:`pg_tcp.transport`, "Blocking sends that do not fit the kernel"). Measured here
(2 ranks, loaded 2-core host, the receiver outside pg-tcp until told through the store): an
8 MiB send returns in 8-10 ms, a 64 MiB one in about 40 ms (the copy of the rest), and the
receiver's ``recv`` 2 s later takes 5-7 ms while the sender computes. Before, 8 MiB waited
until the receiver entered pg-tcp.

What is bounded is the total: the copies may hold ``max_buffered_send_bytes`` (option, default
256 MiB). A send whose copy would go beyond it while earlier ones are still buffered waits for
those to drain, at most its timeout, then raises ``CollectiveTimeout`` naming the option and
what to do. This is a memory budget, not an eager limit, which is why the declaration stays
``None`` rather than the budget: any single send goes out without waiting (one larger than the
budget is taken when nothing else is buffered), and a send of any size, however small, waits
only when the program has left a budget's worth of earlier sends unreceived, the way MPI's
eager sends stall when the library's eager buffers are full. Declaring the budget as the limit
would promise that sends below it never wait, which is no more true, and would tell portable
code to post receives first for sizes that do go out here. Programs that must not depend on it
post their receives first or use ``isend`` (never copied: the tensor stays untouched until the
``Work`` completes), as with MPI and torch.
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
