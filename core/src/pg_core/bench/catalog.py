"""What ``pg-core bench`` measures and against what: the ops (tensor, object, asynchronous),
the families that decide how each is sized, checked and timed, the baselines and the dtypes.
The lowest module of :mod:`pg_core.bench`: every other one reads its names, it reads none of
theirs."""

from __future__ import annotations

from typing import Final

import torch

from ..dtypes import NAMES

__all__ = [
    "ASYNC_OPS",
    "BASELINE",
    "BASELINES",
    "BASELINE_OF",
    "BLOCKING_OF",
    "CONTROL",
    "DTYPES",
    "ECHO_OPS",
    "KNOWN_OPS",
    "MPI4PY",
    "OBJECT_OPS",
    "OPS",
    "REDUCING_OPS",
    "REFERENCE_OPS",
    "ROOT",
    "ROOTED_OPS",
    "SPLIT_OPS",
    "TENSOR_OPS",
    "BenchError",
]


#: Ops on tensors, whose results :func:`~pg_core.bench.inputs.check_output` checks.
TENSOR_OPS: Final[tuple[str, ...]] = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "reduce",
    "send_recv",
    "send_tensor",
)

#: Ops on pickled Python objects (:func:`~pg_core.bench.inputs.request_object`), whose results
#: :func:`~pg_core.bench.inputs.check_object` checks.
OBJECT_OPS: Final[tuple[str, ...]] = ("send_object", "broadcast_object")

#: Every op the benchmark knows, in report order.
OPS: Final[tuple[str, ...]] = TENSOR_OPS + OBJECT_OPS

#: The asynchronous form of an op (``--async``; also named in ``--ops``, never part of ``all``):
#: the same work as the op, called with ``async_op=True`` (point to point: ``isend``/``irecv``) and
#: waited for at once, so its row beside the blocking one is what going asynchronous costs.
ASYNC_OPS: Final[dict[str, str]] = {
    "all_reduce": "all_reduce_async",
    "broadcast": "broadcast_async",
    "send_recv": "isend_irecv",
}

#: An op compared with another op on the same backend and size (besides the baseline):
#: ``send_tensor`` (shape unknown to the receiver) with ``send_recv`` (shape known); each
#: asynchronous form (:data:`ASYNC_OPS`) with its blocking op.
REFERENCE_OPS: Final[dict[str, str]] = {"send_tensor": "send_recv", **{a: b for b, a in ASYNC_OPS.items()}}

#: Every op ``--ops`` accepts: :data:`OPS` and the asynchronous forms.
KNOWN_OPS: Final[tuple[str, ...]] = OPS + tuple(ASYNC_OPS.values())

#: The label of torch's Gloo, measured as the baseline.
BASELINE: Final[str] = "torch-gloo"
#: The label of raw mpi4py on numpy arrays, the baseline with ``--baseline mpi4py``.
MPI4PY: Final[str] = "mpi4py"
#: The baselines ``--baseline`` takes.
BASELINES: Final[tuple[str, ...]] = (BASELINE, MPI4PY)
#: Each baseline's library, as the pg-core backend that wraps it is named: that backend's
#: rows are compared with this baseline (every other backend's with the first one measured),
#: and ``--plot`` draws the baseline dashed in that backend's colour.
BASELINE_OF: Final[dict[str, str]] = {BASELINE: "gloo", MPI4PY: "mpi"}

#: What ``--control`` appends to a baseline's label for its second row (``torch-gloo.again``).
CONTROL: Final[str] = ".again"

#: ``--dtype`` choices: the dtypes of :data:`pg_core.dtypes.NAMES` whose inputs and
#: expected outputs (:func:`~pg_core.bench.inputs.input_values`,
#: :func:`~pg_core.bench.inputs.expected_output`) are exact or within a stated tolerance, and
#: that torch's Gloo reduces.
DTYPES: Final[dict[str, torch.dtype]] = {
    name: NAMES[name] for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64")
}

#: The root of the rooted ops (``broadcast``'s source, ``reduce``'s destination).
ROOT: Final[int] = 0
#: The ops that split their buffer among the ranks (element counts a multiple of the world size).
SPLIT_OPS: Final[frozenset[str]] = frozenset({"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"})
#: The ops that reduce into a buffer, refilled before every iteration.
REDUCING_OPS: Final[frozenset[str]] = frozenset({"all_reduce", "all_reduce_async", "reduce", "reduce_scatter_tensor"})
#: The ops in which rank 0 sends to rank 1, which echoes back; the time is rank 0's round trip / 2.
ECHO_OPS: Final[frozenset[str]] = frozenset({"send_recv", "isend_irecv", "send_tensor", "send_object"})
#: The ops with a root (:data:`ROOT`).
ROOTED_OPS: Final[frozenset[str]] = frozenset({"broadcast", "broadcast_async", "reduce", "broadcast_object"})
#: The blocking op whose work an asynchronous form does (its sizes, outputs and bandwidth factor).
BLOCKING_OF: Final[dict[str, str]] = {a: b for b, a in ASYNC_OPS.items()}


class BenchError(Exception):
    """A usage problem reported as one line and exit status 2."""
