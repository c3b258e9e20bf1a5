"""pg-nccl's entry point: what the registry reads without importing the backend (or CUDA).

The capabilities are those NCCL and torch's ``ProcessGroupNCCL`` document, certified at world
size 1 on an H100 (``pg-core conformance nccl --world-sizes 1 --device cuda``; see the
project's docs/gpu.md); a machine with more GPUs certifies more world sizes. What NCCL lacks is left undeclared, so the core refuses it before
anything is sent:

* ``BAND``/``BOR``/``BXOR``: NCCL has no bitwise reductions.
* bool reduces with ``MIN``/``MAX`` only; integers without ``AVG``.
* complex: ``SUM`` and ``AVG`` (reduced as pairs of reals); no ``PRODUCT``, and no
  ``PREMUL_SUM``, whose factor may be complex.
* ``int16``: NCCL has no 16-bit integer type, so no reductions; copies move its bytes.
* tags: NCCL's point to point has none (``max_tag=None``): messages between two ranks
  match in the order they were sent, and the core keeps that order per peer.
* ``recv_anysource`` (optional, API 1.4): not declared. NCCL has no receive from any source:
  every ``ncclRecv`` names its peer.
* ``eager_limit_bytes=0`` (API 1.10): any send may wait for its receiver. A blocking ``send``
  returns to the host once the current stream waits for torch's work (no host
  synchronisation), but NCCL's ``ncclSend`` completes on the GPU only once the peer's
  ``ncclRecv`` runs (NCCL's documentation: point-to-point calls to one peer must be matched,
  and concurrent ones grouped, or they deadlock), and a pair's sends and receives run in one
  stream's order: two ranks that each send to the other before receiving wait on each other
  on the GPU. So a program posts its receive first on the other rank, or uses
  ``batch_isend_irecv``, as torch's NCCL documentation asks. Reasoned from the code and NCCL's
  documented semantics; no GPU was at hand to measure NCCL's internal buffering, which
  nothing documents as a guarantee.
"""

from __future__ import annotations

import os

import pluggy
import torch
from pg_core.backend import DTYPES, BackendSpec, Capabilities
from pg_core.ops import OPS, RedOpType

__all__ = ["CAPABILITIES", "is_available", "pg_core_backends"]

hookimpl = pluggy.HookimplMarker("pg_core")

_FLOAT = frozenset(
    {RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.AVG, RedOpType.PREMUL_SUM}
)
_INT = frozenset({RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX})

#: cuda: every op and dtype; the reduce ops NCCL has per dtype; no tags; every send may wait for its receiver.
CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES),
    reduce_ops={
        torch.float16: _FLOAT,
        torch.bfloat16: _FLOAT,
        torch.float32: _FLOAT,
        torch.float64: _FLOAT,
        torch.complex64: frozenset({RedOpType.SUM, RedOpType.AVG}),
        torch.complex128: frozenset({RedOpType.SUM, RedOpType.AVG}),
        torch.bool: frozenset({RedOpType.MIN, RedOpType.MAX}),
        torch.uint8: _INT,
        torch.int8: _INT,
        torch.int16: frozenset(),
        torch.int32: _INT,
        torch.int64: _INT,
    },
    max_tag=None,
    eager_limit_bytes=0,
)


def is_available() -> str | None:
    """``None``, or exactly what is missing: torch without CUDA, torch without NCCL, no GPU visible."""
    import torch.distributed as dist

    version = torch.__version__
    if not dist.is_available():
        return f"torch {version} was built without torch.distributed"
    if torch.version.cuda is None:
        return f"torch {version} was built without CUDA (a CPU-only build): install a CUDA build of torch"
    if not dist.is_nccl_available():
        return f"torch {version} was built with CUDA {torch.version.cuda} but without NCCL"
    if torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "unset" if visible is None else repr(visible)
        return f"no GPU is visible (torch.cuda.device_count() is 0; CUDA_VISIBLE_DEVICES is {shown})"
    return None


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    """The ``nccl`` backend: cuda tensors, priority 20 (the default for cuda where it can run)."""
    return [
        BackendSpec(
            name="nccl",
            factory="pg_nccl.backend:NCCLBackend",
            devices=("cuda",),
            capabilities=CAPABILITIES,
            priority=20,
            api_version="1.10",  # collectives launch (1.2); batches coalesce (1.3); eager_limit_bytes (1.10)
            is_available=is_available,
            description="torch's C++ NCCL (ProcessGroupNCCL): one communicator per group and device",
        )
    ]
