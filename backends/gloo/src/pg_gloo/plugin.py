"""pg-gloo's entry point: what the registry reads without importing the backend.

The capabilities below are what Gloo does, found by running every op x dtype x reduce op
against ``ProcessGroupGloo`` (torch 2.13, two processes) and certified by the conformance
suite. A gap is an undeclared capability, so the core refuses it before anything is sent:

* ``PREMUL_SUM``: Gloo has none ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
* complex: Gloo reduces it as pairs of reals, so ``SUM`` and ``AVG`` only (no ``PRODUCT``).
* ``int16``: Gloo has no reductions for it at all, so it declares none. Copies of every
  dtype work: the backend moves a dtype Gloo does not know (``int16``, complex) as bytes.
* bool: ``MIN``, ``MAX`` and the bitwise ops, as for every backend.
* tags: Gloo's are ``int32`` non-negative, so ``max_tag`` is ``2**31 - 1`` and the core maps
  its own tags and the user's into that range.
* ``recv_anysource`` (optional, API 1.4): not declared. Gloo receives from any source, but a
  pg-gloo message above the eager limit is a header and a payload on one tag, and an any-source
  receive can take a payload that a receive naming its sender has not read yet (see the README).
* ``eager_limit_bytes`` (API 1.10): :data:`EAGER_LIMIT_BYTES`, 2 MiB. A send of at most that
  returns at once (a copy, in one Gloo message with its header); a larger one is sent from the
  tensor itself and waits until the receiver has posted its receive, as torch's Gloo ``send``
  does. Chosen by measurement (docs/decisions.md): below it the two copies cost less than the
  second Gloo message a zero-copy send takes (a rendezvous of Gloo's), above it more.

``cuda`` is declared where torch was built with CUDA, with the two ops torch documents for
Gloo on GPUs (``broadcast``, ``all_reduce``; Gloo stages them through host memory),
certified on an H100 at world sizes 1 and 2 (``pg-core conformance gloo --device cuda``).
"""

from __future__ import annotations

import pluggy
import torch
from pg_core.backend import DTYPES, BackendSpec, Capabilities
from pg_core.ops import OPS, RedOpType

__all__ = ["CAPABILITIES", "CUDA_CAPABILITIES", "EAGER_LIMIT_BYTES", "is_available", "pg_core_backends"]

hookimpl = pluggy.HookimplMarker("pg_core")

_FLOAT = frozenset({RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.AVG})
_COMPLEX = frozenset({RedOpType.SUM, RedOpType.AVG})
_INT = frozenset(
    {RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}
)
_BOOL = frozenset({RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR})

_REDUCE_OPS = {
    torch.float16: _FLOAT,
    torch.bfloat16: _FLOAT,
    torch.float32: _FLOAT,
    torch.float64: _FLOAT,
    torch.complex64: _COMPLEX,
    torch.complex128: _COMPLEX,
    torch.bool: _BOOL,
    torch.uint8: _INT,
    torch.int8: _INT,
    torch.int16: frozenset(),
    torch.int32: _INT,
    torch.int64: _INT,
}

#: Gloo's tags are C ``int``: non-negative ones go up to 2**31 - 1.
MAX_TAG = 2**31 - 1

#: The largest send that never waits for its receiver (``Capabilities.eager_limit_bytes``); every
#: rank of a group must agree on it, as it shapes the messages (:mod:`pg_gloo.messages`).
EAGER_LIMIT_BYTES = 2 << 20

#: cpu: every op and dtype, the reduce ops Gloo has per dtype.
CAPABILITIES = Capabilities(
    ops=frozenset(OPS),
    dtypes=frozenset(DTYPES),
    reduce_ops=_REDUCE_OPS,
    max_tag=MAX_TAG,
    eager_limit_bytes=EAGER_LIMIT_BYTES,
)

#: cuda (torch built with CUDA): what torch documents for Gloo on GPUs, certified on an H100.
CUDA_CAPABILITIES = Capabilities(
    ops=frozenset({"all_reduce", "broadcast"}),
    dtypes=frozenset(DTYPES),
    reduce_ops=_REDUCE_OPS,
    max_tag=MAX_TAG,
    eager_limit_bytes=EAGER_LIMIT_BYTES,
)


def is_available() -> str | None:
    """``None``, or why Gloo cannot run here (a torch built without distributed or Gloo)."""
    import torch.distributed as dist

    if not dist.is_available():
        return f"torch {torch.__version__} was built without torch.distributed"
    if not dist.is_gloo_available():
        return f"torch {torch.__version__} was built without Gloo (torch.distributed.is_gloo_available() is False)"
    return None


@hookimpl
def pg_core_backends() -> list[BackendSpec]:
    """The ``gloo`` backend: cpu tensors (and cuda where torch has CUDA). Priority 5: pg-tcp
    (10) stays the default for ``backends=None``, so installing pg-gloo changes no existing
    group; name it (``backends="gloo"``) to use it."""
    devices: tuple[str, ...] = ("cpu", "cuda") if torch.version.cuda else ("cpu",)
    capabilities = {"cpu": CAPABILITIES, "cuda": CUDA_CAPABILITIES}
    return [
        BackendSpec(
            name="gloo",
            factory="pg_gloo.backend:GlooBackend",
            devices=devices,
            capabilities={d: capabilities[d] for d in devices},
            priority=5,
            api_version="1.10",  # Capabilities.eager_limit_bytes
            is_available=is_available,
            description="torch's C++ Gloo (ProcessGroupGloo), one per group, built from the group's store",
        )
    ]
