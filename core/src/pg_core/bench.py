"""``pg-core bench``: an nccl-tests-style sweep of collectives, correctness-checked,
with the raw libraries (torch's own Gloo, mpi4py) measured side by side in the same run.

    python -m pg_core.bench --world-size 2 --backends tcp --sizes 4,1K,64K,1M
    pg-core bench --backends tcp,gloo,mpi --ops all_reduce -b 8 -e 64M -f 2 --plot allreduce.png
    pg-core bench --ops all_reduce,send_recv --minbytes 8 --maxbytes 16M --stepfactor 4 --json
    pg-core bench --backends tcp --ops send_object,broadcast_object,send_tensor,send_recv --sizes 4K

**What runs.** The program hosts a ``TCPStore`` and starts ``--world-size`` rank
processes of its own (one thread of intra-op parallelism each). Every rank forms
one :class:`~pg_core.ProcessGroup` per pg-core backend named in ``--backends``
(a name that ``pg-core backends`` lists, or ``module:attr`` / ``path/file.py:attr``
of a ``BackendSpec`` or ``Backend`` subclass under development, read as ``pg-core
conformance`` reads it: :func:`pg_core.registry.resolve_backend_ref`; by default
every backend available for cpu, a backend whose ranks a launcher must start
included when it is available in a process started that way), plus, unless
``--no-baseline``, the baselines: torch's ``ProcessGroupGloo`` used directly
through its own API, labelled ``torch-gloo``, and raw mpi4py (``MPI_COMM_WORLD``
on numpy views of the tensors, labelled ``mpi4py``). ``--baseline`` names them
(comma-separated); its default, ``auto``, is ``torch-gloo``, plus ``mpi4py``
when mpiexec starts the ranks anyway. Rows are measured in the order op, size,
backend, so the baselines and the pg-core backends are measured one right after
the other at each op and size. A backend whose spec declares a launcher (pg-mpi:
``mpiexec``), or the mpi4py baseline, has every rank started by that launcher,
in one command; the other backends and baselines run in those ranks as well, so
``--backends tcp,gloo,mpi`` is one run and one table.

**Objects and unknown shapes.** Besides the tensor collectives, three ops measure
what torch.distributed makes painful. ``send_object`` (pg-core's
``send_object``/``recv_object``; torch's ``send_object_list``/``recv_object_list``)
and ``broadcast_object`` (``broadcast_object`` against ``broadcast_object_list``)
carry :func:`request_object`: a serving request as a dict of a few strings, ints,
a list and nested sampling parameters, plus a ``bytes`` payload of the requested
size. ``send_tensor`` sends a tensor whose shape (:func:`tensor_shape`) and dtype
the receiver does not know: pg-core's ``send_tensor``/``recv_tensor`` against the
three send/recv pairs a torch user writes (number of dimensions and dtype, shape,
data). Its table has a ``vs send_recv`` column, its median over the plain
``send``/``recv`` of a known shape on the same backend at the same size, when
``send_recv`` is in ``--ops`` too. torch's object functions need
``init_process_group``, which the baseline then calls in the rank processes (see
``_TorchGlooRunner``).

**Asynchronous calls.** ``--async`` measures each selected op that has an asynchronous form
(:data:`ASYNC_OPS`) in that form too, right after it at each size: ``all_reduce_async`` and
``broadcast_async`` call the group with ``async_op=True`` and ``wait()`` at once,
``isend_irecv`` is ``send_recv``'s echo with ``isend(...).wait()`` and ``irecv(...).wait()``
(raw mpi4py: ``Iallreduce``, ``Ibcast``, ``Isend``, ``Irecv``; torch's Gloo returns a work
either way). Its ``vs`` column is its median over the blocking op's on the same backend and
size, and their difference in microseconds: what going asynchronous costs. The forms can
be named in ``--ops`` too; ``all`` leaves them out.

**Sizes.** ``--sizes 4,64K,1M`` lists them; ``-b 8 -e 64M -f 2`` (nccl-tests'
spelling; also ``--minbytes``, ``--maxbytes``, ``--stepfactor`` and the older
``--min-bytes``, ``--max-bytes``, ``--factor``) sweeps from ``-b`` to ``-e``,
multiplying by ``-f`` (:func:`sweep_sizes`: the one rule, checked before any rank
starts). A size is the bytes of the largest buffer on one rank, as nccl-tests
counts it: the tensor of ``all_reduce``, ``broadcast``, ``reduce`` and the
message of ``send_recv`` and ``send_tensor``; the *output* of ``all_gather_into_tensor`` (each rank
contributes ``size / n``); the *input* of ``reduce_scatter_tensor``; input and
output of ``all_to_all_single``. Element counts are rounded down to a multiple
of the world size where the op splits the buffer (at least one element per
rank); the ``size`` column shows the bytes actually moved, ``requested_size``
the bytes asked for. For the object ops the requested size is the payload's
bytes (``count``), and ``size`` the whole object pickled with protocol 5.

**What is timed.** For each (op, size, backend) every rank runs one or two
untimed iterations (up to three, fewer if ``--warmup`` says so), then rank 0 plans,
at the median pace of those after the first, how many more untimed warmup iterations
(up to ``--warmup``) and how many timed ones to run: at least 5 and at most
``--iters``, as many as fit in ``--time-budget`` seconds.
After a barrier, timed iterations run back to back; each is timed on its own
with ``time.perf_counter_ns`` around the blocking call. An iteration's time is
the *maximum over ranks* (the collective is done when the slowest rank is);
for ``send_recv``, ``send_tensor`` and ``send_object`` rank 0 sends to rank 1
and rank 1 echoes what it received back, and the time is rank 0's round trip
divided by 2 (one-way latency); serializing and deserializing are inside it. Buffers
that an op reduces into (``all_reduce``, ``reduce``, the input of
``reduce_scatter_tensor``) are refilled before every iteration, outside the
timed region. With ``--rounds R`` (R > 1) the rows of one (op, size) are timed
together: every runner warms up and is planned as above, all of them then get the
smallest of their plans (so the blocks a ratio pairs are alike), and each runs its
share of its timed iterations (after a barrier and one untimed iteration) in turn, R
times over, each round starting one row further along (no row is always the one right
after another, or right after the barrier); each row's statistics are over all its
iterations. A drift of the machine's
speed during the run (another tenant, frequency, the host's scheduler) then weighs on
each row alike rather than on whichever ran during it, which is what a ratio of two
rows measured seconds apart is most sensitive to.

**What is reported.** ``min``/``median``/``max`` of the per-iteration times,
in microseconds; ``algbw = size / median time`` and ``busbw = algbw * factor``
in GB/s (1e9 bytes/s), with nccl-tests' factors: ``2(n-1)/n`` for
``all_reduce``, ``(n-1)/n`` for ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single``, 1 for the others. For a pg-core backend, ``ratio`` is its median
time divided by its baseline's median at the same op and size: the baseline of
the library it wraps (:func:`compared_with`: ``gloo`` against ``torch-gloo``,
``mpi`` against ``mpi4py``) when measured, else the first baseline. ``0.85x
torch-gloo`` means 15% less time than torch's Gloo, ``2.00x`` twice as long.
With ``--rounds R``, each row also keeps the median of each round's iterations
(``round_median_us``), and a pg-core backend's row the ratios of its round medians
to its baseline's, round by round (``round_ratios``): each pairs blocks timed
moments apart, so a slow spell of the machine weighs on both sides of one ratio.
The table shows their middle half after the ratio (``1.03x torch-gloo
[1.01-1.05]``): how far the ratio can be trusted in this run. ``--control`` times each
baseline a second time as a row of its own (``torch-gloo.again``, a Gloo object of its
own; ``mpi4py.again``, the same calls), compared with the first like a backend: two rows
doing the very same work, so its ratio is what this run's noise alone makes of 1.00x.
``--json`` and ``--csv`` give every row; ``--plot PNG`` draws median time and
bus bandwidth against size (:func:`plot_figure`). On stderr, a line per row
(not with ``--quiet``) and, when stderr is a terminal, a progress bar below them
(:class:`pg_core.progress.ProgressBar`).

**Correctness.** Rank ``r`` fills its input with ``(r + 1) * (1 + i % 3)`` at
element ``i`` (exact in every supported dtype for small world sizes); outputs
are poisoned before the last timed iteration, and after it every rank compares
its output with the value :func:`expected_output` computes in float64 (for
``send_tensor`` also its shape and dtype; for the object ops, equality with
:func:`request_object`). A mismatch marks the row ``WRONG`` (with the first bad
element) and makes the exit status 1.

**Noise.** Absolute times depend on the machine, its load, CPU frequency and
where the scheduler puts the ranks; the median resists outliers, not a busy
machine. Compare the ratios, measured side by side in one run, rather than
absolute times across runs or machines. Placement can matter more than anything
else on a small (virtual) machine: with two ranks on two CPUs, Gloo's send/recv
was seen to take either ~40 us or a whole scheduler tick (~2 ms one way) depending
on whether the two ranks shared a CPU, and pg-tcp to be faster sharing one.
``--pin-ranks`` puts rank ``r`` on the ``r``-th allowed CPU, so the placement is
the same in every run.

**Bounds.** ``--timeout`` bounds every operation, store access and group
formation in the ranks; the parent additionally kills ranks that make no
progress (after dumping their Python stacks), shows the traceback of a rank that
fails, exits non-zero, and never leaves a rank process behind.

Exit status: 0 when every row is correct, 1 when a row is ``WRONG`` or a rank
failed, 2 for bad arguments or a backend that cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import pickle
import re
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, TextIO, TypeVar

import torch

from .dtypes import NAMES, dtype_code, dtype_from_code, dtype_name
from .launchers import launch_command
from .procs import EXIT_UNKNOWN, LaunchedRanks, RankProcesses, adopt_launched_rank, prepare_rank, tail
from .progress import ProgressBar

if TYPE_CHECKING:
    from .backend import BackendSpec
    from .registry import PluginEntry

T = TypeVar("T")

__all__ = [
    "ASYNC_OPS",
    "BASELINE",
    "BASELINES",
    "BASELINE_OF",
    "CONTROL",
    "DTYPES",
    "KNOWN_OPS",
    "MAX_SIZES",
    "MPI4PY",
    "OBJECT_OPS",
    "OPS",
    "REFERENCE_OPS",
    "TENSOR_OPS",
    "BenchError",
    "Row",
    "add_parser",
    "busbw_factor",
    "check_object",
    "check_output",
    "compared_with",
    "describe_backends",
    "element_count",
    "expected_output",
    "format_csv",
    "format_json",
    "format_table",
    "input_values",
    "main",
    "object_size",
    "output_length",
    "output_shape",
    "parse_factor",
    "parse_size",
    "plan_iterations",
    "plot_colours",
    "plot_figure",
    "request_object",
    "requested_sizes",
    "rotated",
    "sweep_order",
    "sweep_sizes",
    "tensor_shape",
    "write_plot",
]

#: Ops on tensors, whose results :func:`check_output` checks.
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

#: Ops on pickled Python objects (:func:`request_object`), whose results :func:`check_object` checks.
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
#: expected outputs (:func:`input_values`, :func:`expected_output`) are exact or within
#: a stated tolerance, and that torch's Gloo reduces.
DTYPES: Final[dict[str, torch.dtype]] = {
    name: NAMES[name] for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64")
}

DEFAULT_SIZES: Final[str] = "4,1K,64K,1M,64M"
#: ``-b``, ``-e`` and ``-f`` where a sweep names only some of them.
DEFAULT_SWEEP: Final[tuple[str, str, str]] = ("4", "64M", "2")
#: The most sizes one sweep may have (a step factor barely above 1 would make millions).
MAX_SIZES: Final[int] = 1000
MIN_ITERS: Final[int] = 5

_ROOT: Final[int] = 0  # root of broadcast and reduce
_POISON: Final[int] = -1  # never an expected value: every expected value is positive
_NOTHING: Final[object] = object()  # an object op's result before the op has left one
_SPLIT_OPS: Final[frozenset[str]] = frozenset({"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"})
_REDUCING_OPS: Final[frozenset[str]] = frozenset({"all_reduce", "all_reduce_async", "reduce", "reduce_scatter_tensor"})
# rank 0 sends to rank 1, which echoes back; the time is rank 0's round trip / 2
_ECHO_OPS: Final[frozenset[str]] = frozenset({"send_recv", "isend_irecv", "send_tensor", "send_object"})
_ROOTED_OPS: Final[frozenset[str]] = frozenset({"broadcast", "broadcast_async", "reduce", "broadcast_object"})
#: the blocking op whose work an asynchronous form does (its sizes, outputs and bandwidth factor)
_BLOCKING_OF: Final[dict[str, str]] = {a: b for b, a in ASYNC_OPS.items()}
_RTOL: Final[dict[torch.dtype, float]] = {
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
    torch.float32: 1e-6,
    torch.float64: 1e-12,
}
_WORKER_FLAG: Final[str] = "__worker__"
_UNITS: Final[dict[str, int]] = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BenchError(Exception):
    """A usage problem reported as one line and exit status 2."""


# -- sizes, counts and bandwidth ---------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"1M"``, ``"2G"`` (binary units; ``KB``/``KiB`` alike)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size: expected bytes such as 4, 64K, 1M or 2G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sweep_order(ops: Sequence[str], sizes: Sequence[int]) -> list[tuple[str, int]]:
    """(op, size) in the order they are measured: op by op, size by size, except that an
    op's reference op (:data:`REFERENCE_OPS`), when selected too, is measured right after it
    at each size, and the ops that refer to it (its asynchronous form) right after it, so the
    ``vs`` ratio compares rows taken moments apart."""
    order: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()
    for op in ops:
        ref = REFERENCE_OPS.get(op)
        others = ([ref] if ref is not None and ref in ops else []) + [o for o in ops if REFERENCE_OPS.get(o) == op]
        for size in sizes:
            for item in [(op, size)] + [(o, size) for o in others]:
                if item not in seen:
                    seen.add(item)
                    order.append(item)
    return order


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes`` (nccl-tests' ``-b -e -f``),
    each rounded to whole bytes, repeats dropped.

    The one rule for a sweep: ``1 <= min_bytes <= max_bytes``, ``factor`` a finite number
    greater than 1, and at most :data:`MAX_SIZES` sizes. Raises ``ValueError`` saying which
    is broken and how."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"a sweep needs 1 <= -b/--minbytes <= -e/--maxbytes, got {min_bytes} and {max_bytes} bytes")
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"-f/--stepfactor must be a finite number greater than 1, got {factor:g}")
    steps = math.floor(math.log(max_bytes / min_bytes) / math.log(factor) + 1e-9) + 1
    if steps > MAX_SIZES:
        raise ValueError(
            f"-b {min_bytes} -e {max_bytes} -f {factor:g} makes {steps} sizes, more than {MAX_SIZES}: "
            "raise -f/--stepfactor or narrow the range"
        )
    sizes: list[int] = []
    size = float(min_bytes)
    while round(size) <= max_bytes:
        if not sizes or round(size) != sizes[-1]:
            sizes.append(round(size))
        size *= factor
    return sizes


def parse_factor(text: str) -> float:
    """The step factor of a sweep from ``"2"`` or ``"1.5"`` (checked by :func:`sweep_sizes`)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"-f/--stepfactor: cannot read {text!r} as a number, such as 2 or 1.5") from None


def requested_sizes(
    sizes: str | None, min_bytes: str | None = None, max_bytes: str | None = None, factor: str | None = None
) -> list[int]:
    """The sizes a run sweeps, from the command line's text: either ``--sizes`` (a
    comma-separated list) or nccl-tests' ``-b``/``-e``/``-f`` (``--minbytes``,
    ``--maxbytes``, ``--stepfactor``; any of them, the others defaulting to
    :data:`DEFAULT_SWEEP`), never both; neither gives :data:`DEFAULT_SIZES`. Sizes take
    K/M/G suffixes (:func:`parse_size`). Raises ``ValueError`` with what to change."""
    sweep = (min_bytes, max_bytes, factor)
    if any(v is not None for v in sweep):
        if sizes is not None:
            raise ValueError("give either --sizes or -b/-e/-f (--minbytes/--maxbytes/--stepfactor), not both")
        lo, hi, f = (d if v is None else v for v, d in zip(sweep, DEFAULT_SWEEP, strict=True))
        return sweep_sizes(_option_size("-b/--minbytes", lo), _option_size("-e/--maxbytes", hi), parse_factor(f))
    listed = [parse_size(s) for s in _csv_list(sizes or DEFAULT_SIZES)]
    if not listed:
        raise ValueError(f"--sizes: no size given in {sizes!r}; give bytes such as 4,64K,1M")
    if min(listed) < 1:
        raise ValueError(f"--sizes: every size must be at least 1 byte, got {min(listed)}")
    return list(dict.fromkeys(listed))


def _option_size(option: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def element_count(op: str, nbytes: int, world_size: int, itemsize: int) -> int:
    """Elements of the largest per-rank buffer for ``nbytes`` (see the module docstring);
    for an object op, the bytes of the object's payload (``nbytes`` itself)."""
    if op in OBJECT_OPS:
        return max(1, nbytes)
    count = max(1, nbytes // itemsize)
    if op in _SPLIT_OPS:
        count = max(world_size, count // world_size * world_size)
    return count


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: ``busbw = algbw * factor``."""
    n = world_size
    op = _BLOCKING_OF.get(op, op)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in _SPLIT_OPS:
        return (n - 1) / n
    if op in ("broadcast", "reduce", *_ECHO_OPS, *OBJECT_OPS):
        return 1.0
    raise ValueError(f"unknown op {op!r}; known ops: {', '.join(KNOWN_OPS)}")


def plan_iterations(probe_ns: int, warmup: int, warmup_done: int, max_iters: int, budget_s: float) -> tuple[int, int]:
    """``(more_warmup, iters)`` for an op that took ``probe_ns`` once warm.

    Timed iterations: as many as fit in ``budget_s`` after the remaining warmup,
    but at least :data:`MIN_ITERS` (or ``max_iters`` if smaller) and at most
    ``max_iters``. Remaining warmup: up to ``warmup - warmup_done``, spending at
    most a fifth of the budget.
    """
    per_iter = max(probe_ns, 1) / 1e9
    more = max(0, min(warmup - warmup_done, math.floor(0.2 * budget_s / per_iter)))
    fit = math.floor((budget_s - more * per_iter) / per_iter)
    iters = min(max_iters, max(min(MIN_ITERS, max_iters), fit))
    return more, iters


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` in the order round ``turn`` of ``--rounds`` takes them: each round starts one
    further along, so no row is always the one timed right after a barrier or right after a
    given other row (what comes before a block, warm caches or a busy core, is shared out)."""
    if not items:
        return []
    k = turn % len(items)
    return [*items[k:], *items[:k]]


# -- inputs and expected outputs ---------------------------------------------------------------


def _pattern(index: torch.Tensor) -> torch.Tensor:
    return (index % 3 + 1).to(torch.float64)


def input_values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: ``(rank + 1) * (1 + i % 3)`` at element ``i``."""
    period = (_pattern(torch.arange(3)) * (rank + 1)).to(dtype)
    return period.repeat(-(-count // 3))[:count].clone()


def output_length(op: str, world_size: int, count: int) -> int:
    """Elements of ``op``'s output on one rank (``count`` from :func:`element_count`)."""
    return count // world_size if op == "reduce_scatter_tensor" else count


def tensor_shape(count: int) -> tuple[int, int]:
    """The shape ``send_tensor`` sends ``count`` elements in: rows of up to 64 elements,
    ``(count // w, w)`` with ``w = gcd(count, 64)`` (``(16, 64)`` for 4 KiB of float32)."""
    width = math.gcd(count, 64)
    return (count // width, width)


def output_shape(op: str, world_size: int, count: int) -> tuple[int, ...]:
    """The shape of ``op``'s output on one rank: :func:`tensor_shape` for ``send_tensor``,
    one dimension of :func:`output_length` elements for every other tensor op."""
    if op == "send_tensor":
        return tensor_shape(count)
    return (output_length(op, world_size, count),)


def request_object(payload_bytes: int) -> dict[str, Any]:
    """The object that ``send_object`` and ``broadcast_object`` carry: what a serving
    request looks like (ids, a model name, prompt token ids, sampling parameters, flags),
    plus ``payload``, a ``bytes`` of ``payload_bytes`` bytes so the size follows ``--sizes``.

    Plain bytes, not a tensor, on purpose: both pickle them the same way in-band,
    so neither side gains from how it treats tensors inside objects.
    """
    payload = bytes(i * 7 % 251 for i in range(min(payload_bytes, 251)))
    return {
        "request_id": "cmpl-7f3a9c2e4b1d4e8f",
        "model": "llama-3.1-8b-instruct",
        "prompt_token_ids": [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 128009],
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256, "stop": ["</s>", "\n\n"]},
        "priority": 3,
        "stream": True,
        "payload": (payload * (payload_bytes // 251 + 1))[:payload_bytes],
    }


def object_size(payload_bytes: int) -> int:
    """Bytes of :func:`request_object` pickled (protocol 5): the ``size`` of an object op's row."""
    return len(pickle.dumps(request_object(payload_bytes), protocol=5))


def expected_output(
    op: str, rank: int, world_size: int, count: int, *, start: int = 0, stop: int | None = None
) -> torch.Tensor | None:
    """What ``rank``'s output must hold (float64) after ``op`` on inputs from :func:`input_values`,
    elements ``start:stop`` of it (default: all), or ``None`` where the op defines
    no output on that rank.

    ``count`` is :func:`element_count`'s: the elements of the largest per-rank
    buffer. Roots (``broadcast`` source, ``reduce`` destination) are rank 0; for
    ``send_recv`` and ``send_tensor`` both rank 0 (after the echo) and rank 1 hold
    rank 0's input (``send_tensor``'s flattened: its shape is :func:`output_shape`'s).
    """
    if op in OBJECT_OPS:
        raise ValueError(f"{op} has no tensor output: its result is request_object(count)")
    if op not in KNOWN_OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(KNOWN_OPS)}")
    op = _BLOCKING_OF.get(op, op)  # an asynchronous form leaves what its blocking op leaves
    if (op == "reduce" and rank != _ROOT) or (op in _ECHO_OPS and rank > 1):
        return None
    n = world_size
    total = n * (n + 1) / 2  # sum of (r + 1) over ranks
    length = output_length(op, n, count)
    j = torch.arange(start, length if stop is None else min(stop, length))
    if op in ("all_reduce", "reduce"):
        return _pattern(j) * total
    if op in ("broadcast", "send_recv", "send_tensor"):  # the input of rank 0
        return _pattern(j)
    block = count // n
    if op == "reduce_scatter_tensor":  # block `rank` of everyone's input, summed
        return _pattern(rank * block + j) * total
    source, k = j // block, j % block  # output block `source` came from rank `source`
    if op == "all_gather_into_tensor":
        return _pattern(k) * (source + 1)
    return _pattern(rank * block + k) * (source + 1)  # all_to_all_single: block `rank` of its input


_CHECK_CHUNK: Final[int] = 1 << 22  # elements compared at a time, so checking 1 GiB needs no 8 GiB


def check_output(
    op: str, rank: int, world_size: int, count: int, output: torch.Tensor | None, *, dtype: torch.dtype | None = None
) -> str | None:
    """``None`` if ``output`` is what ``op`` must leave on ``rank`` (its shape, its
    values and, when ``dtype`` is given, its dtype), else what is wrong."""
    if expected_output(op, rank, world_size, count, stop=0) is None:
        return None
    if output is None:
        return f"{op}: rank {rank} has no output to check"
    length = output_length(op, world_size, count)
    shape = output_shape(op, world_size, count)
    if tuple(output.shape) != shape:
        return f"{op}: rank {rank} output has shape {tuple(output.shape)}, expected {shape}"
    if dtype is not None and output.dtype != dtype:
        return f"{op}: rank {rank} output has dtype {output.dtype}, expected {dtype}"
    flat = output.reshape(-1)
    rtol = _RTOL.get(output.dtype, 0.0)
    wrong, first, detail = 0, -1, ""
    for start in range(0, length, _CHECK_CHUNK):
        expected = expected_output(op, rank, world_size, count, start=start, stop=start + _CHECK_CHUNK)
        assert expected is not None
        got = flat[start : start + _CHECK_CHUNK].detach().to("cpu", torch.float64)
        bad = ~torch.isclose(got, expected, rtol=rtol, atol=0.0)
        here = int(bad.sum())
        if here and first < 0:
            at = int(bad.nonzero()[0, 0])
            first = start + at
            detail = f"got {got[at].item():g}, expected {expected[at].item():g}"
        wrong += here
    if wrong == 0:
        return None
    return f"{op}: rank {rank}: {wrong} of {length} elements wrong; first at index {first}: {detail}"


def check_object(op: str, rank: int, world_size: int, count: int, output: object) -> str | None:
    """``None`` if ``output`` is what the object op ``op`` must leave on ``rank``
    (:func:`request_object` of ``count`` payload bytes: on every rank for
    ``broadcast_object``, on ranks 0 and 1 for ``send_object``), else what is wrong."""
    if op not in OBJECT_OPS:
        raise ValueError(f"{op!r} is not an object op; object ops: {', '.join(OBJECT_OPS)}")
    if op == "send_object" and rank > 1:
        return None
    expected = request_object(count)
    if output == expected:
        return None
    return f"{op}: rank {rank}: {_difference(output, expected)}"


def _difference(got: object, expected: object, where: str = "the object") -> str:
    """Where ``got`` first differs from ``expected``, in words."""
    if got is _NOTHING:
        return "no object received"
    if type(got) is not type(expected):
        return f"{where} is a {type(got).__name__}, expected a {type(expected).__name__}"
    if isinstance(got, dict) and isinstance(expected, dict):
        if got.keys() != expected.keys():
            missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
            return f"{where} lacks keys {missing} and has extra keys {extra}"
        key = next(k for k in expected if got[k] != expected[k])
        return _difference(got[key], expected[key], f"{where}[{key!r}]")
    if isinstance(got, bytes | list | str) and isinstance(expected, bytes | list | str):
        if len(got) != len(expected):
            return f"{where} has length {len(got)}, expected {len(expected)}"
        at = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        return f"{where} differs first at index {at}: got {got[at]!r}, expected {expected[at]!r}"
    return f"{where} is {got!r}, expected {expected!r}"


# -- rows and reports --------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One measured (op, size, backend). Times in microseconds, bandwidths in GB/s.

    ``status``: ``"ok"``, ``"WRONG"`` (``detail`` says what) or ``"skipped"``
    (``detail`` says why). ``ratio`` is this row's median over the baseline's
    median at the same op and size (pg-core backends only, when the baseline ran).
    ``ref_ratio`` is this row's median over that of ``ref_op`` (:data:`REFERENCE_OPS`)
    on the same backend at the same size, when that row was measured in the run, and
    ``ref_diff_us`` their difference (this row's median minus that one's, microseconds):
    for an asynchronous form (:data:`ASYNC_OPS`), what ``async_op=True`` plus ``wait()``
    costs over the blocking call.
    For object ops ``dtype`` is ``"object"``, ``count`` the payload's bytes and
    ``size`` the pickled object's bytes.
    """

    op: str
    backend: str
    baseline: bool
    size: int
    requested_size: int
    count: int
    dtype: str
    world_size: int
    warmup: int
    iters: int
    min_us: float | None
    median_us: float | None
    max_us: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    status: str
    detail: str | None = None
    ratio: float | None = None
    ratio_to: str | None = None
    ref_ratio: float | None = None
    ref_op: str | None = None
    ref_diff_us: float | None = None
    rounds: int = 1  # --rounds: blocks the timed iterations came in, interleaved with the other rows'
    #: with ``--rounds R`` (R > 1): the median of each round's iterations, in round order
    round_median_us: list[float] | None = None
    #: with ``--rounds R``: this row's round median over its baseline's in the same round, round by round
    round_ratios: list[float] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def compared_with(label: str, baselines: Sequence[str]) -> str | None:
    """The baseline that backend ``label``'s rows are compared with, of ``baselines`` (those
    measured, in order): the one whose library it wraps (:data:`BASELINE_OF`; ``gloo`` with
    ``torch-gloo``, ``mpi`` with ``mpi4py``), else the first; ``None`` if none was measured."""
    if label in baselines:  # a --control row: the same baseline, timed again
        return label
    own = [b for b in baselines if BASELINE_OF.get(b) == label]
    return own[0] if own else next(iter(baselines), None)


def _add_ratios(rows: list[Row]) -> None:
    baselines = list(dict.fromkeys(r.backend for r in rows if r.baseline))
    base = {(r.op, r.size, r.backend): r for r in rows if r.baseline and r.median_us}
    same = {(r.op, r.size, r.backend): r for r in rows if r.median_us}
    for row in rows:
        if row.median_us is None:
            continue
        against = None if row.baseline else compared_with(row.backend.split(".")[0], baselines)
        ref = None if against is None else base.get((row.op, row.size, against))
        if ref is not None and ref.median_us:
            row.ratio = row.median_us / ref.median_us
            row.ratio_to = ref.backend
            mine, theirs = row.round_median_us, ref.round_median_us
            if mine and theirs and len(mine) == len(theirs) and all(theirs):
                row.round_ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        ref_op = REFERENCE_OPS.get(row.op)
        other = None if ref_op is None else same.get((ref_op, row.size, row.backend))
        if other is not None and other.median_us:
            row.ref_ratio = row.median_us / other.median_us
            row.ref_diff_us = row.median_us - other.median_us
            row.ref_op = ref_op


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (at least one): the middle half's ends."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: What each baseline is, for the report's list of what it shows.
_BASELINE_IS: Final[dict[str, str]] = {
    BASELINE: "baseline: torch's own ProcessGroupGloo, called through torch's API (not pg-core)",
    MPI4PY: "baseline: raw mpi4py on MPI_COMM_WORLD (not pg-core)",
}


def describe_backends(labels: Sequence[str], entries: Sequence[PluginEntry]) -> list[str]:
    """What each backend of ``labels`` (the rows' ``backend``, in order) is, one line each,
    from the plugin registry's ``entries``: its distribution and version, and the summary
    that distribution's metadata gives (``importlib.metadata``): a plugin published as an
    example says so there. A baseline says what it calls; ``.again`` / ``.to_torch`` rows are
    their backend's; a backend no installed plugin provides (a ``module:attr`` reference) says that."""
    from importlib import metadata

    def canonical(distribution: str) -> str:
        return re.sub(r"[-_.]+", "-", distribution).lower()

    lines = []
    for label in dict.fromkeys(labels):
        if label.endswith((CONTROL, ".to_torch")):
            continue  # a variant row of a backend described on its own line
        name, _, pin = label.partition("@")  # "tcp@pg-tcp": a pinned distribution
        entry = next(
            (e for e in entries if e.name == name and (not pin or canonical(e.distribution or "") == canonical(pin))),
            None,
        )
        if name in _BASELINE_IS:
            what = _BASELINE_IS[name]
        elif entry is None or entry.distribution is None:
            what = "not an installed plugin (a spec given by reference, or registered in-process)"
        else:
            what = f"{entry.distribution} {entry.version or ''}".rstrip()
            with contextlib.suppress(metadata.PackageNotFoundError):
                summary = metadata.metadata(entry.distribution).json.get("summary")
                if summary:
                    what += f": {summary}"
        lines.append(f"{label}: {what}")
    return lines


def format_table(rows: Sequence[Row], about: Sequence[str] = ()) -> str:
    """One nccl-tests-style table per op, then a legend; ``about``: a line per backend shown,
    what it is (:func:`describe_backends`), listed first in the legend."""
    out: list[str] = []
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        ref_op = REFERENCE_OPS.get(op)
        header = ["size", "count", "backend", "iters", "min", "median", "max", "algbw", "busbw", "ratio"]
        header += [] if ref_op is None else [f"vs {ref_op}"]
        lines = [[*header, "check"]]
        for r in mine:
            check = r.status if r.status != "skipped" else f"skipped: {r.detail}"
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x {r.ratio_to}"
            if r.round_ratios:
                low, high = quartiles(r.round_ratios)
                ratio += f" [{low:.2f}-{high:.2f}]"
            line = [
                str(r.size),
                str(r.count),
                r.backend,
                str(r.iters) if r.median_us is not None else "-",
                _fmt(r.min_us, ".1f"),
                _fmt(r.median_us, ".1f"),
                _fmt(r.max_us, ".1f"),
                _fmt(r.algbw_gbps, ".3f"),
                _fmt(r.busbw_gbps, ".3f"),
                ratio,
            ]
            if ref_op is not None:
                diff = "" if r.ref_diff_us is None else f" {r.ref_diff_us:+.1f}us"
                line.append("-" if r.ref_ratio is None else f"{r.ref_ratio:.2f}x{diff}")
            lines.append([*line, check])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        out.append(f"# {op} ({_what(op, mine[0])})")
        for line in lines:
            cells = [c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=False))]
            out.append(("  ".join(cells) + "  " + line[-1]).rstrip())
        out.append("")
    if about:
        out.append("# backends:")
        out.extend(f"#   {line}" for line in about)
    out.append(
        "# size: bytes of the largest buffer per rank; count: its elements. min/median/max: microseconds per\n"
        "# iteration (slowest rank). algbw = size / median, busbw = algbw * nccl-tests factor, in GB/s.\n"
        "# ratio: median time / its baseline's median at the same op and size (below 1x is faster); a backend's\n"
        "# baseline is the raw library it wraps (gloo: torch-gloo, mpi: mpi4py) when measured, else the first.\n"
        "# Compare ratios measured side by side in one run, not absolute times across runs or machines."
    )
    if any(r.round_ratios for r in rows):
        out.append("# [a-b] (--rounds): the middle half of the ratios of each round's medians, round by round.")
    if any(r.op in OBJECT_OPS for r in rows):
        out.append("# Object ops: size is the pickled object's bytes (protocol 5), count its payload's bytes.")
    if any(r.op in REFERENCE_OPS for r in rows):
        out.append(
            "# vs OP: median time / OP's median on the same backend and size (needs OP in --ops too), and\n"
            "# median minus OP's median; send_tensor vs send_recv is the cost of a shape the receiver does not\n"
            "# know; an asynchronous form (--async) vs its op is the cost of async_op=True plus wait()."
        )
    return "\n".join(out)


def _what(op: str, first: Row) -> str:
    """What a table's rows measure, for its heading."""
    if op in OBJECT_OPS:
        what = f"world size {first.world_size}, request_object() with a payload of `count` bytes"
    else:
        what = f"world size {first.world_size}, {first.dtype}"
    if op in _REDUCING_OPS:
        what += ", sum"
    if op in _ROOTED_OPS:
        what += f", root {_ROOT}"
    if op == "send_tensor":
        what += ", shape unknown to the receiver"
    if op in _BLOCKING_OF:
        what += ", async_op=True then wait()" if op != "isend_irecv" else ", isend().wait() then irecv().wait()"
    if op in _ECHO_OPS:
        what += ", ranks 0<->1, one-way time = round trip / 2"
    if first.rounds > 1:
        what += f", interleaved in {first.rounds} rounds"
    return what


def format_json(rows: Sequence[Any]) -> str:
    """Rows (dataclass instances: :class:`Row`, :class:`pg_core.overhead.OverheadRow`) as a
    JSON list of objects (every field)."""
    return json.dumps([dataclasses.asdict(r) for r in rows], indent=2)


def format_csv(rows: Sequence[Any], row_type: type = Row) -> str:
    """Rows of ``row_type`` (a dataclass) as CSV with a header line (every field)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[f.name for f in dataclasses.fields(row_type)], lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(dataclasses.asdict(r))
    return buf.getvalue()


def _require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install matplotlib")


_MARKERS: Final[str] = "os^Dv<>px*"


def plot_colours(rows: Sequence[Row]) -> dict[str, str]:
    """Each backend's colour in :func:`write_plot` (matplotlib's ``C0``, ``C1``, ...): the pg-core
    backends in the order measured, then each baseline in the colour of the backend that wraps
    its library (:data:`BASELINE_OF`) where that one was measured, else in one of its own."""
    colours: dict[str, str] = {}
    for backend in dict.fromkeys(r.backend for r in rows if not r.baseline):
        colours[backend] = f"C{len(colours) % 10}"
    for backend in dict.fromkeys(r.backend for r in rows if r.baseline):
        own = colours.get(BASELINE_OF.get(backend, ""))
        colours[backend] = own if own is not None else f"C{len(set(colours.values())) % 10}"
    return colours


def plot_figure(rows: Sequence[Row]) -> Any:
    """The figure :func:`write_plot` saves (a ``matplotlib.figure.Figure``): a row of panels
    per op, its own axes never shared with another op: median time per iteration (µs, or
    ms / s where the times are that long) and, where the op has one, bus bandwidth (GB/s),
    against the message size per rank in bytes (ticks as ``4 B``, ``64 KiB``, ``1 MiB``),
    log-log; one line per backend (a marker each), baselines dashed in their backend's colour
    (:func:`plot_colours`); one legend for the figure, below the panels, off the data.
    Needs matplotlib (``BenchError`` without it)."""
    _require_matplotlib()
    from matplotlib.figure import Figure

    timed = [r for r in rows if r.median_us]
    if not timed:
        raise BenchError("--plot: no row has a time to plot")
    ops = list(dict.fromkeys(r.op for r in timed))
    colours = plot_colours(timed)
    backends = list(dict.fromkeys(r.backend for r in timed))
    markers = {b: _MARKERS[i % len(_MARKERS)] for i, b in enumerate(backends)}
    fig = Figure(figsize=(12, 3.6 * len(ops) + 1.4), layout="constrained")
    panels = fig.subplots(len(ops), 2, squeeze=False, sharex="row")
    handles: dict[str, Any] = {}
    for (latency, bandwidth), op in zip(panels, ops, strict=True):
        mine = [r for r in timed if r.op == op]
        unit, scale = _time_unit(max(r.median_us or 0.0 for r in mine))
        for backend in dict.fromkeys(r.backend for r in mine):
            points = sorted((r for r in mine if r.backend == backend), key=lambda r: r.size)
            style = {
                "color": colours[backend],
                "linestyle": "--" if points[0].baseline else "-",
                "marker": markers[backend],
                "markersize": 4,
                "label": backend,
            }
            (line,) = latency.plot([r.size for r in points], [(r.median_us or 0.0) / scale for r in points], **style)
            handles.setdefault(backend, line)
            bw = [(r.size, r.busbw_gbps) for r in points if r.busbw_gbps]
            if bw:
                bandwidth.plot(*zip(*bw, strict=True), **style)
        sizes = sorted({r.size for r in mine})
        latency.set_title(f"{op}: median time (lower is better)")
        latency.set_ylabel(f"median time per iteration ({unit})")
        bandwidth.set_title(f"{op}: bus bandwidth (higher is better)")
        bandwidth.set_ylabel("bus bandwidth (GB/s)")
        for ax in (latency, bandwidth):
            _size_axis(ax, sizes)
        if not bandwidth.get_lines():
            bandwidth.text(0.5, 0.5, f"no bandwidth for {op}", ha="center", va="center", transform=bandwidth.transAxes)
            bandwidth.set_yticks([])
            bandwidth.set_ylabel("")
    first = timed[0]
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in timed))
    fig.suptitle(f"pg-core bench: world size {first.world_size}, {dtypes}")
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncols=min(len(handles), 6),
        title="backend (dashed: a raw library measured as the baseline)",
        fontsize="small",
    )
    return fig


def _time_unit(longest_us: float) -> tuple[str, float]:
    """The unit an axis of times up to ``longest_us`` microseconds reads best in, and its
    size in microseconds."""
    if longest_us >= 1e7:
        return "s", 1e6
    if longest_us >= 1e4:
        return "ms", 1e3
    return "µs", 1.0


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """Log-log axes against the message size: at most 8 size ticks, at the measured sizes
    where they are that few, else at every k-th power of two between them; plain numbers on
    the other axis (1, 2, 5, 10, 20, ... over up to three decades of data, else 0.01, 0.1, 1,
    ...), not powers of ten written as such. Call it once the data is drawn."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if len(sizes) <= 8:
        ticks = list(sizes)
    else:
        low, high = max(sizes[0], 1).bit_length() - 1, max(sizes[-1], 1).bit_length()
        step = max(1, math.ceil((high - low) / 8))
        ticks = [1 << k for k in range(low, high + 1, step)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _human(round(x))))
    ax.xaxis.set_minor_locator(NullLocator())
    low_y, high_y = ax.dataLim.y0, ax.dataLim.y1
    few_decades = low_y > 0 and high_y / low_y <= 1000  # 1, 2, 5 per decade; over more, powers of ten
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if few_decades else (1.0,), numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size per rank (bytes)")
    ax.grid(True, which="major", alpha=0.3)


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Save :func:`plot_figure` of ``rows`` as ``path`` (PNG, or what its suffix names)."""
    plot_figure(rows).savefig(path, dpi=120)


# -- the configuration that travels to the ranks ------------------------------------------------


@dataclasses.dataclass
class _Config:
    world_size: int
    backends: list[str]  # registry names or module:attr
    labels: list[str]
    baselines: list[str]  # of BASELINES, measured in this order
    ops: list[str]
    sizes: list[int]
    dtype: str
    iters: int
    warmup: int
    time_budget: float
    timeout: float
    pin_ranks: bool = False
    to_torch: bool = False
    control: bool = False  # --control: each baseline timed a second time, as a row of its own
    rounds: int = 1
    port: int = 0
    results: str = ""
    parent_pid: int = 0
    #: how the ranks are started (BackendSpec.launcher of a backend measured, or the mpi4py baseline's)
    launcher: str | None = None

    def runners(self) -> int:
        return len(self.backends) * (2 if self.to_torch else 1) + len(self.baselines) * (2 if self.control else 1)


# -- the ranks -------------------------------------------------------------------------------------


class _Runner(Protocol):
    label: str
    is_baseline: bool

    def why_not(self, op: str, dtype: torch.dtype) -> str | None: ...
    def barrier(self) -> bool: ...
    def all_reduce(self, t: torch.Tensor) -> None: ...
    def all_reduce_async(self, t: torch.Tensor) -> None: ...
    def broadcast(self, t: torch.Tensor, src: int) -> None: ...
    def broadcast_async(self, t: torch.Tensor, src: int) -> None: ...
    def reduce(self, t: torch.Tensor, dst: int) -> None: ...
    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...
    def send(self, t: torch.Tensor, dst: int) -> None: ...
    def recv(self, t: torch.Tensor, src: int) -> None: ...
    def isend_wait(self, t: torch.Tensor, dst: int) -> None: ...
    def irecv_wait(self, t: torch.Tensor, src: int) -> None: ...
    def send_tensor(self, t: torch.Tensor, dst: int) -> None: ...
    def recv_tensor(self, src: int) -> torch.Tensor: ...
    def send_object(self, obj: object, dst: int) -> None: ...
    def recv_object(self, src: int) -> object: ...
    def broadcast_object(self, obj: object, src: int) -> object: ...
    def close(self) -> None: ...


# the ProcessGroup methods each op calls (beyond the backend ops that ``supports`` answers for)
_GROUP_METHODS: Final[dict[str, tuple[str, ...]]] = {
    "send_tensor": ("send_tensor", "recv_tensor"),
    "send_object": ("send_object", "recv_object"),
    "broadcast_object": ("broadcast_object",),
}


class _PgCoreRunner:
    """A pg-core ProcessGroup, through its public API."""

    is_baseline = False

    def __init__(self, store: Any, rank: int, size: int, *, spec: str, label: str, timeout: float) -> None:
        from .group import ProcessGroup
        from .registry import resolve_backend_ref

        self.label = label
        value = resolve_backend_ref(spec, "cpu")
        self.group = ProcessGroup(
            store, rank=rank, size=size, backends={"cpu": value}, name=f"bench-{label}", timeout=timeout
        )

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        from .ops import ReduceOp

        for method in _GROUP_METHODS.get(op, ()):
            if not callable(getattr(self.group, method, None)):
                return f"this pg-core's ProcessGroup has no {method}"
        if op == "broadcast_object":
            return None  # built by the core on whatever the backend declares
        reduce_op = ReduceOp.SUM if op in _REDUCING_OPS else None
        of = None if op == "send_object" else dtype
        for name in ("send", "recv") if op in _ECHO_OPS else (_BLOCKING_OF.get(op, op),):
            if not self.group.supports(name, "cpu", of, reduce_op):
                return f"{self.label} does not declare {name}" + ("" if of is None else f" for {dtype_name(of)}")
        return None

    def barrier(self) -> bool:
        if not self.group.supports("barrier"):
            return False
        self.group.barrier()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t)

    def all_reduce_async(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.group.broadcast(t, src)

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        self.group.broadcast(t, src, async_op=True).wait()  # type: ignore[union-attr]

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        self.group.reduce(t, dst)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.all_gather_into_tensor(out, inp)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.reduce_scatter_tensor(out, inp)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.group.all_to_all_single(out, inp)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.group.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.group.recv(t, src)

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.group.isend(t, dst).wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.group.irecv(t, src).wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        self.group.send_tensor(t, dst)

    def recv_tensor(self, src: int) -> torch.Tensor:
        got: torch.Tensor = self.group.recv_tensor(src)
        return got

    def send_object(self, obj: object, dst: int) -> None:
        self.group.send_object(obj, dst)

    def recv_object(self, src: int) -> object:
        return self.group.recv_object(src)

    def broadcast_object(self, obj: object, src: int) -> object:
        return self.group.broadcast_object(obj, src)

    def close(self) -> None:
        self.group.shutdown()


class _TorchGlooRunner:
    """torch's ``ProcessGroupGloo``, created directly (no ``init_process_group``) and used
    through its own API; for the object ops, torch's ``send_object_list``,
    ``recv_object_list`` and ``broadcast_object_list`` on the default group.

    Those three need a group that torch.distributed's registry knows (``recv`` turns
    the source's group rank into a global rank through it), which only
    ``init_process_group`` or ``new_group`` (which needs the former) provide. So when
    an object op is measured, this runner calls ``init_process_group("gloo")`` on a
    store prefix of its own: acceptable here because the rank processes are the
    benchmark's own and nothing else in them uses torch's default group.

    ``send_tensor`` is what a torch user writes for a tensor whose shape the receiver
    does not know: three blocking send/recv pairs on the same ``ProcessGroupGloo``
    (int64 ``[ndim, dtype code]``, then the int64 shape, then the data).
    """

    is_baseline = True
    label = BASELINE

    def __init__(
        self, store: Any, rank: int, size: int, timeout: float, *, objects: bool = False, control: bool = False
    ) -> None:
        import torch.distributed as dist

        prefix = "bench-torch-gloo" + ("-control" if control else "")  # a control row: a Gloo object of its own
        self._options(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout)))
        if control:
            self.label, self.is_baseline = BASELINE + CONTROL, False
        self._default_group = objects and not dist.is_initialized()
        if self._default_group:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("bench-torch-gloo-objects", store),
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=timeout),
            )

    def _options(self, pg: Any) -> None:
        """Use ``pg`` (torch's API), with the options each call passes made once."""
        import torch.distributed as dist

        self._dist = dist
        self.pg: Any = pg
        sum_op: Any = dist.ReduceOp.SUM  # torch's stubs type it as RedOpType; the options want a ReduceOp
        self._bcast = dist.BroadcastOptions()
        self._bcast.rootRank = _ROOT
        self._bcast.rootTensor = 0
        self._reduce = dist.ReduceOptions()
        self._reduce.rootRank = _ROOT
        self._reduce.rootTensor = 0
        self._reduce.reduceOp = sum_op
        self._rs = dist.ReduceScatterOptions()
        self._rs.reduceOp = sum_op

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        return None

    def barrier(self) -> bool:
        self.pg.barrier().wait()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def all_reduce_async(self, t: torch.Tensor) -> None:  # torch's calls return a Work either way
        self.pg.allreduce([t]).wait()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        assert src == _ROOT
        self.pg.broadcast([t], self._bcast).wait()

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        assert src == _ROOT
        self.pg.broadcast([t], self._bcast).wait()

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        assert dst == _ROOT
        self.pg.reduce([t], self._reduce).wait()

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg._allgather_base(out, inp).wait()

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg._reduce_scatter_base(out, inp, self._rs).wait()

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pg.alltoall_base(out, inp, [], [], self._dist.AllToAllOptions()).wait()

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0).wait()

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0).wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        header = torch.tensor([t.dim(), dtype_code(t.dtype)], dtype=torch.int64)  # pg-core's wire codes
        self.pg.send([header], dst, 0).wait()
        self.pg.send([torch.tensor(t.shape, dtype=torch.int64)], dst, 0).wait()
        self.pg.send([t], dst, 0).wait()

    def recv_tensor(self, src: int) -> torch.Tensor:
        header = torch.empty(2, dtype=torch.int64)
        self.pg.recv([header], src, 0).wait()
        ndim, code = header.tolist()
        shape = torch.empty(ndim, dtype=torch.int64)
        self.pg.recv([shape], src, 0).wait()
        dtype = dtype_from_code(code)
        if dtype is None:
            raise ValueError(f"send_tensor: received unknown dtype code {code}")
        t = torch.empty(shape.tolist(), dtype=dtype)
        self.pg.recv([t], src, 0).wait()
        return t

    def send_object(self, obj: object, dst: int) -> None:
        self._dist.send_object_list([obj], dst=dst)

    def recv_object(self, src: int) -> object:
        got: list[object] = [None]
        self._dist.recv_object_list(got, src=src)
        return got[0]

    def broadcast_object(self, obj: object, src: int) -> object:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src)
        return box[0]

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pg = None
        if self._default_group:
            self._dist.destroy_process_group()


class _Mpi4pyRunner:
    """Raw mpi4py on ``MPI_COMM_WORLD``, on numpy views of the tensors (``Tensor.numpy()``, no
    copy): the baseline with ``--baseline mpi4py``, whose ranks an MPI launcher started. Tensor
    collectives and ``send_recv``; the value ops are pg-core's business, not MPI's."""

    is_baseline = True
    label = MPI4PY

    def __init__(self, *, control: bool = False) -> None:
        from mpi4py import MPI  # initialises MPI (mpi4py's defaults: MPI_THREAD_MULTIPLE), unless it is already

        self._mpi = MPI
        self.comm: Any = MPI.COMM_WORLD  # a control row too: the very calls of the baseline's row
        if control:
            self.label, self.is_baseline = MPI4PY + CONTROL, False

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        if op in ("send_tensor", *OBJECT_OPS):
            return "raw mpi4py has no such operation (it is what pg-core adds)"
        try:
            torch.empty(0, dtype=dtype).numpy()
        except TypeError:
            return f"numpy has no {dtype_name(dtype)}"
        return None

    def barrier(self) -> bool:
        self.comm.Barrier()
        return True

    def all_reduce(self, t: torch.Tensor) -> None:
        self.comm.Allreduce(self._mpi.IN_PLACE, t.numpy())

    def all_reduce_async(self, t: torch.Tensor) -> None:
        self.comm.Iallreduce(self._mpi.IN_PLACE, t.numpy()).Wait()

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self.comm.Bcast(t.numpy(), root=src)

    def broadcast_async(self, t: torch.Tensor, src: int) -> None:
        self.comm.Ibcast(t.numpy(), root=src).Wait()

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        if self.comm.Get_rank() == dst:
            self.comm.Reduce(self._mpi.IN_PLACE, t.numpy(), root=dst)
        else:
            self.comm.Reduce(t.numpy(), None, root=dst)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Allgather(inp.numpy(), out.numpy())

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Reduce_scatter_block(inp.numpy(), out.numpy())

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.Alltoall(inp.numpy(), out.numpy())

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.comm.Send(t.numpy(), dst, 0)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.comm.Recv(t.numpy(), src, 0)

    def isend_wait(self, t: torch.Tensor, dst: int) -> None:
        self.comm.Isend(t.numpy(), dst, 0).Wait()

    def irecv_wait(self, t: torch.Tensor, src: int) -> None:
        self.comm.Irecv(t.numpy(), src, 0).Wait()

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def recv_tensor(self, src: int) -> torch.Tensor:
        raise NotImplementedError

    def send_object(self, obj: object, dst: int) -> None:
        raise NotImplementedError

    def recv_object(self, src: int) -> object:
        raise NotImplementedError

    def broadcast_object(self, obj: object, src: int) -> object:
        raise NotImplementedError

    def close(self) -> None:
        self.comm = None  # MPI_COMM_WORLD is MPI's; mpi4py finalises MPI at exit


class _ToTorchRunner(_TorchGlooRunner):
    """A pg-core group's ``to_torch()``, through torch's ``ProcessGroup`` API: the calls the
    torch-gloo baseline makes, so the two rows compare the group's torch face with raw Gloo."""

    is_baseline = False

    def __init__(self, of: _PgCoreRunner) -> None:
        self._options(of.group.to_torch())
        self.label = f"{of.label}.to_torch"
        self._default_group = False

    def why_not(self, op: str, dtype: torch.dtype) -> str | None:
        if op in OBJECT_OPS or op == "send_tensor":
            return f"{op} is a pg-core group method, not a torch ProcessGroup one"
        return None

    def close(self) -> None:
        self.pg = None  # the group's own runner shuts the group down


@dataclasses.dataclass
class _Slot:
    """One runner's row of one (op, size) between its warmup and its report."""

    index: int
    runner: _Runner
    row: Row
    case: _Case | None  # None on a rank that takes no part
    times: list[int] = dataclasses.field(default_factory=list)  # this rank's, ns


@dataclasses.dataclass
class _Case:
    """One op on one runner with its buffers: ``run`` is what is timed."""

    run: Callable[[], None]
    refill: Callable[[], None]  # before every iteration (outside the timing)
    poison: Callable[[], None]  # before the last one, so a stale output cannot pass
    output: Callable[[], object]  # a tensor (None if missing), or an object op's result


def _noop() -> None:
    return None


def _make_case(op: str, r: _Runner, *, rank: int, n: int, count: int, dtype: torch.dtype) -> _Case | None:
    """The buffers and the call for ``op``; ``None`` on ranks that take no part (the
    echo ops beyond rank 1)."""
    if op in ("send_tensor", "send_object", "broadcast_object"):
        return _make_returning_case(op, r, rank=rank, count=count, dtype=dtype)
    if op in ("all_reduce", "all_reduce_async", "reduce", "broadcast", "broadcast_async"):
        pristine = input_values(rank, count, dtype)
        buf = pristine.clone()

        def restore() -> None:
            buf.copy_(pristine)

        if op == "all_reduce":
            return _Case(lambda: r.all_reduce(buf), restore, _noop, lambda: buf)
        if op == "all_reduce_async":
            return _Case(lambda: r.all_reduce_async(buf), restore, _noop, lambda: buf)
        if op == "broadcast_async":
            return _Case(lambda: r.broadcast_async(buf, _ROOT), _noop, restore, lambda: buf)
        if op == "reduce":
            return _Case(lambda: r.reduce(buf, _ROOT), restore, _noop, lambda: buf)
        # broadcast: the root's buffer is unchanged; other ranks' own inputs differ from the root's
        return _Case(lambda: r.broadcast(buf, _ROOT), _noop, restore, lambda: buf)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        pristine = input_values(rank, count // n if op == "all_gather_into_tensor" else count, dtype)
        inp = pristine.clone()
        out = torch.empty(count // n if op == "reduce_scatter_tensor" else count, dtype=dtype)

        def refill_input() -> None:
            inp.copy_(pristine)

        def poison() -> None:
            out.fill_(_POISON)

        if op == "all_gather_into_tensor":
            return _Case(lambda: r.all_gather_into_tensor(out, inp), _noop, poison, lambda: out)
        if op == "reduce_scatter_tensor":
            return _Case(lambda: r.reduce_scatter_tensor(out, inp), refill_input, poison, lambda: out)
        return _Case(lambda: r.all_to_all_single(out, inp), _noop, poison, lambda: out)
    if op in ("send_recv", "isend_irecv"):
        if rank > 1:
            return None
        msg = input_values(0, count, dtype)
        got = torch.empty(count, dtype=dtype)

        def poison_got() -> None:
            got.fill_(_POISON)

        send, recv = (r.send, r.recv) if op == "send_recv" else (r.isend_wait, r.irecv_wait)
        if rank == 0:

            def ping() -> None:
                send(msg, 1)
                recv(got, 1)

            return _Case(ping, _noop, poison_got, lambda: got)

        def pong() -> None:
            recv(got, 0)
            send(got, 0)

        return _Case(pong, _noop, poison_got, lambda: got)
    raise ValueError(f"unknown op {op!r}")


def _make_returning_case(op: str, r: _Runner, *, rank: int, count: int, dtype: torch.dtype) -> _Case | None:
    """The ops whose receivers get a new tensor or object (checked: the last one received)."""
    got: list[object] = [_NOTHING]

    def poison() -> None:
        got[0] = _NOTHING

    def output() -> object:
        return None if got[0] is _NOTHING and op == "send_tensor" else got[0]

    if op == "broadcast_object":
        obj = request_object(count) if rank == _ROOT else None

        def bcast() -> None:
            got[0] = r.broadcast_object(obj, _ROOT)

        return _Case(bcast, _noop, poison, output)
    if rank > 1:
        return None
    if op == "send_tensor":
        msg: object = input_values(0, count, dtype).reshape(tensor_shape(count))
        send: Callable[[Any, int], None] = r.send_tensor
        recv: Callable[[int], object] = r.recv_tensor
    else:
        msg, send, recv = request_object(count), r.send_object, r.recv_object
    if rank == 0:

        def ping() -> None:
            send(msg, 1)
            got[0] = recv(1)

        return _Case(ping, _noop, poison, output)

    def pong() -> None:
        got[0] = recv(0)
        send(got[0], 0)

    return _Case(pong, _noop, poison, output)


def _timed(run: Callable[[], None]) -> int:
    start = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - start


class _Rank:
    """What one rank process does: form the groups, run every row, report to rank 0 via the store."""

    def __init__(self, cfg: _Config, rank: int) -> None:
        from .store import PrefixStore, TCPStore

        self.cfg, self.rank = cfg, rank
        self.dtype = DTYPES[cfg.dtype]
        store = TCPStore("127.0.0.1", cfg.port, is_master=False, timeout=timedelta(seconds=cfg.timeout))
        self.store = store
        self.ctl = PrefixStore("pg-core-bench", store)
        self.runners: list[_Runner] = []
        objects = any(op in OBJECT_OPS for op in cfg.ops)
        for control in (False, True) if cfg.control else (False,):
            for baseline in cfg.baselines:
                if baseline == MPI4PY:
                    self.runners.append(_Mpi4pyRunner(control=control))
                else:
                    self.runners.append(
                        _TorchGlooRunner(store, rank, cfg.world_size, cfg.timeout, objects=objects, control=control)
                    )
        for spec, label in zip(cfg.backends, cfg.labels, strict=True):
            runner = _PgCoreRunner(store, rank, cfg.world_size, spec=spec, label=label, timeout=cfg.timeout)
            self.runners.append(runner)
            if cfg.to_torch:
                self.runners.append(_ToTorchRunner(runner))
        self.results: TextIO | None = open(cfg.results, "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def emit(self, event: str, **fields: Any) -> None:
        if self.results is not None:
            self.results.write(json.dumps({"event": event, **fields}) + "\n")

    def run(self) -> None:
        cfg = self.cfg
        self.emit("start")
        index = 0
        for op, requested in sweep_order(cfg.ops, cfg.sizes):
            count = element_count(op, requested, cfg.world_size, self.dtype.itemsize)
            # one runner after the other; with --rounds R > 1, every runner's iterations interleaved
            batches = [[runner] for runner in self.runners] if cfg.rounds == 1 else [self.runners]
            for batch in batches:
                slots: list[_Slot] = []
                for runner in batch:
                    index += 1
                    ready = self._ready(index, op, requested, count, runner)
                    if isinstance(ready, _Slot):
                        slots.append(ready)
                    elif ready is not None:
                        self.emit("row", **dataclasses.asdict(ready))
                if cfg.rounds > 1 and slots:
                    # every row of the comparison the same number of timed iterations (each rank
                    # knows every plan), so round b's blocks are alike on every side of a ratio
                    common = min(slot.row.iters for slot in slots)
                    for slot in slots:
                        slot.row.iters = common
                for block in range(cfg.rounds):
                    for slot in rotated(slots, block):
                        self._block(slot, block)
                for slot in slots:
                    row = self._finish(slot)
                    if row is not None:
                        self.emit("row", **dataclasses.asdict(row))
        # every rank done before any group goes away, so no peer sees a closed connection mid-op
        self.ctl.set(f"finished/{self.rank}", "1")
        self.ctl.wait([f"finished/{q}" for q in range(cfg.world_size)], timedelta(seconds=cfg.timeout))
        for runner in self.runners:
            runner.close()
        self.emit("done")

    def _sync(self, runner: _Runner, key: str) -> None:
        """Line the ranks up: the runner's own barrier, or one on the store if it declares none."""
        if runner.barrier():
            return
        if int(self.ctl.add(f"sync/{key}", 1)) == self.cfg.world_size:
            self.ctl.set(f"sync/{key}/go", "1")
        self.ctl.wait([f"sync/{key}/go"], timedelta(seconds=self.cfg.timeout))

    def _base_row(self, op: str, requested: int, count: int, runner: _Runner) -> Row:
        objects = op in OBJECT_OPS
        return Row(
            op=op,
            backend=runner.label,
            baseline=runner.is_baseline,
            size=object_size(count) if objects else count * self.dtype.itemsize,
            requested_size=requested,
            count=count,
            dtype="object" if objects else self.cfg.dtype,
            world_size=self.cfg.world_size,
            warmup=0,
            iters=0,
            min_us=None,
            median_us=None,
            max_us=None,
            algbw_gbps=None,
            busbw_gbps=None,
            status="skipped",
        )

    def _ready(self, index: int, op: str, requested: int, count: int, runner: _Runner) -> _Slot | Row | None:
        """Row ``index`` warmed up and planned (a :class:`_Slot`); or, where the runner cannot
        run it, its skipped row on rank 0 (``None`` elsewhere)."""
        cfg, rank, n = self.cfg, self.rank, self.cfg.world_size
        row = self._base_row(op, requested, count, runner)
        reason = "needs world size >= 2" if op in _ECHO_OPS and n < 2 else runner.why_not(op, self.dtype)
        if reason is not None:  # the same on every rank: nobody runs it
            row.detail = reason
            return row if rank == 0 else None
        case = _make_case(op, runner, rank=rank, n=n, count=count, dtype=self.dtype)
        self._sync(runner, f"{index}/start")
        first = max(1, min(cfg.warmup, 3))
        probes = []
        for _ in range(first):
            if case is not None:
                case.refill()
                probes.append(_timed(case.run))
        # the median of the probes after the first (which pays for first use): one iteration
        # caught by a scheduler tick would plan a tenth of the iterations the budget allows
        probe = int(statistics.median(probes[1:] or probes)) if probes else 0
        if rank == 0:
            more, iters = plan_iterations(probe, cfg.warmup, first, cfg.iters, cfg.time_budget)
            self.ctl.set(f"plan/{index}", f"{more} {iters}")
            self.emit(
                "plan", index=index, op=op, backend=runner.label, size=row.size, probe_ns=probe, runs=more + iters
            )
        else:
            more, iters = (int(x) for x in self.ctl.get(f"plan/{index}").decode().split())
        if case is not None:
            for _ in range(more):
                case.refill()
                case.run()
        row.warmup, row.iters, row.rounds = first + more, iters, cfg.rounds
        return _Slot(index, runner, row, case)

    def _block(self, slot: _Slot, block: int) -> None:
        """Timed block ``block`` of ``--rounds``: its share of the slot's iterations, after a
        barrier (and, between other runners' blocks, one untimed iteration); the output
        poisoned before the very last."""
        rounds, case, iters = self.cfg.rounds, slot.case, slot.row.iters  # iters: planned, over every round
        share = iters * (block + 1) // rounds - iters * block // rounds
        if share == 0:
            return
        self._sync(slot.runner, f"{slot.index}/timed/{block}")
        if case is None:
            return
        if rounds > 1:
            slot.row.warmup += 1
            case.refill()
            case.run()
        for _ in range(share):
            case.refill()
            if len(slot.times) == iters - 1:
                case.poison()
            slot.times.append(_timed(case.run))

    def _finish(self, slot: _Slot) -> Row | None:
        """Check this rank's output and report its times; on rank 0, the row from every rank's."""
        index, row, rank, n = slot.index, slot.row, self.rank, self.cfg.world_size
        op = row.op
        if slot.case is not None:
            error = self._check(op, row.count, slot.case.output())
            self.ctl.set(f"result/{index}/{rank}", json.dumps({"ns": slot.times, "error": error}))
        if rank != 0:
            return None
        per_rank: list[list[int]] = []
        errors: list[str] = []
        for q in range(2 if op in _ECHO_OPS else n):
            key = f"result/{index}/{q}"
            got = json.loads(self.ctl.get(key))
            self.ctl.delete_key(key)
            per_rank.append(got["ns"])
            if got["error"]:
                errors.append(got["error"])
        if op in _ECHO_OPS:  # rank 0's round trips, halved
            per_iter = [t / 2 for t in per_rank[0]]
        else:  # the slowest rank, iteration by iteration
            per_iter = [float(max(ts)) for ts in zip(*per_rank, strict=True)]
        us = [t / 1e3 for t in per_iter]
        row.min_us, row.median_us, row.max_us = min(us), statistics.median(us), max(us)
        rounds = self.cfg.rounds
        if rounds > 1 and len(us) >= rounds:  # each round's share, as _block took them
            bounds = [len(us) * b // rounds for b in range(rounds + 1)]
            row.round_median_us = [statistics.median(us[a:z]) for a, z in itertools.pairwise(bounds) if z > a]
        row.algbw_gbps = row.size / row.median_us / 1e3 if row.median_us > 0 else None
        row.busbw_gbps = None if row.algbw_gbps is None else row.algbw_gbps * busbw_factor(op, n)
        row.status = "WRONG" if errors else "ok"
        row.detail = "; ".join(errors) or None
        return row

    def _check(self, op: str, count: int, output: object) -> str | None:
        n = self.cfg.world_size
        if op in OBJECT_OPS:
            return check_object(op, self.rank, n, count, output)
        if output is not None and not isinstance(output, torch.Tensor):
            return f"{op}: rank {self.rank} received a {type(output).__name__}, not a tensor"
        return check_output(op, self.rank, n, count, output, dtype=self.dtype)

    def close(self) -> None:
        if self.results is not None:
            self.results.close()


def _worker_main(argv: Sequence[str]) -> int:
    config_path = argv[1]
    cfg = _Config(**json.loads(Path(config_path).read_text()))
    # "-": a launcher started the ranks; the rank is the launcher's, the log and pid go next to the config
    rank = adopt_launched_rank(Path(config_path).parent) if argv[0] == "-" else int(argv[0])
    if cfg.pin_ranks:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    # one intra-op thread, stacks on SIGUSR1, dies with the parent (a launched rank's parent is the
    # launcher's helper: stopping the launcher's session ends it instead)
    prepare_rank(parent_pid=None if cfg.launcher else cfg.parent_pid)
    worker = _Rank(cfg, rank)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


# -- the parent ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Outcome:
    rows: list[Row]
    failure: str | None


class _Results:
    """Rank 0's event file, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with self.path.open() as f:
                f.seek(self._offset)
                data = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        data = self._partial + data
        *lines, self._partial = data.split("\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)


def _run_ranks(cfg: _Config, progress: TextIO | None, *, bar: bool = False) -> _Outcome:
    """Start the ranks, follow them to the end, stop them. ``progress``: where a line per row
    goes (``None``: nowhere); ``bar``: also keep a :class:`~pg_core.progress.ProgressBar` on it
    (only for a terminal: see :meth:`~pg_core.progress.ProgressBar.wanted`)."""
    from .store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout))
    rows: list[Row] = []
    total = len(cfg.ops) * len(cfg.sizes) * cfg.runners()
    with tempfile.TemporaryDirectory(prefix="pg-core-bench-") as tmp:
        tmpdir = Path(tmp)
        cfg = dataclasses.replace(cfg, port=store.port, results=str(tmpdir / "results.jsonl"), parent_pid=os.getpid())
        config_path = tmpdir / "config.json"
        config_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # this very module in worker mode; its folder goes last on sys.path, so it shadows nothing
        src = str(Path(__file__).resolve().parent.parent)
        boot = f"import sys; sys.path.append({src!r}); from pg_core.bench import _cli; sys.exit(_cli())"
        commands = [[sys.executable, "-c", boot, _WORKER_FLAG, str(r), str(config_path)] for r in range(cfg.world_size)]
        results = _Results(Path(cfg.results))
        ranks: RankProcesses | None = None
        shown = ProgressBar(progress, total) if bar and progress is not None else None
        try:
            if shown is not None:
                shown.update(current="starting the ranks, forming their groups")
            if cfg.launcher is not None:  # one launcher command starts them all (BackendSpec.launcher)
                argv = [sys.executable, "-c", boot, _WORKER_FLAG, "-", str(config_path)]
                # the launcher's default: a rank that fails ends the job, and the launcher's status is its
                command = launch_command(cfg.launcher, cfg.world_size, argv)
                ranks = LaunchedRanks(command, cfg.world_size, env=env, log_dir=tmpdir)
            else:
                ranks = RankProcesses(commands, env=env, log_dir=tmpdir)
            failure = _supervise(
                cfg, ranks=ranks, results=results, rows=rows, total=total, progress=progress, bar=shown
            )
        finally:
            if shown is not None:
                shown.close()
            if ranks is not None:
                ranks.stop()
            del store
    return _Outcome(rows, failure)


def _supervise(
    cfg: _Config,
    *,
    ranks: RankProcesses,
    results: _Results,
    rows: list[Row],
    total: int,
    progress: TextIO | None,
    bar: ProgressBar | None = None,
) -> str | None:
    """Follow rank 0's events until every rank exits; return why the run failed, if it did."""
    t = cfg.timeout
    deadline = time.monotonic() + t + 120.0  # import torch, form every group
    waiting_for = "the ranks to start and form their groups"
    done = False
    planned = 0.0  # seconds the rows planned since the last row came should take (--rounds: all of them)
    while True:
        for event in results.read():
            kind = event.pop("event")
            now = time.monotonic()
            if kind == "start":
                deadline, waiting_for = now + 3 * t + 30.0, "the first measurement"
            elif kind == "plan":
                planned += event["runs"] * event["probe_ns"] / 1e9
                deadline = now + 3 * planned + 2 * t + 30.0
                waiting_for = f"{event['op']} {event['size']} B on {event['backend']}"
                if bar is not None:
                    bar.update(current=f"{event['op']} {_human(event['size'])} on {event['backend']}")
            elif kind == "row":
                row = Row.from_dict(event)
                rows.append(row)
                planned = 0.0
                deadline, waiting_for = now + 3 * t + 30.0, "the next measurement"
                if progress is not None:
                    took = "" if row.median_us is None else f"median {row.median_us:.1f} us over {row.iters} iters, "
                    check = row.status if row.status != "skipped" else f"skipped ({row.detail})"
                    line = f"bench: [{len(rows)}/{total}] {row.op} {row.size} B {row.backend}: {took}{check}"
                    if bar is not None:
                        bar.done = len(rows)
                        bar.print(line)
                    else:
                        progress.write(line + "\n")
                        progress.flush()
            elif kind == "done":
                done, waiting_for = True, "the ranks to exit"
                if bar is not None:
                    bar.update(current="the ranks exit")
                deadline = now + t + 30.0
        codes = ranks.poll()
        if isinstance(ranks, LaunchedRanks):  # a rank gone before its launcher: exiting; the launcher says how
            codes = [None if c == EXIT_UNKNOWN else c for c in codes]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            running = [r for r, c in enumerate(codes) if c is None]
            stacks = ranks.dump_stacks(running)
            ranks.stop()
            parts = [
                f"rank {r} exited with status {codes[r]}; its output ends with:\n{_said(ranks.tail(r, lines=60))}"
                for r in failed
            ]
            parts += [f"rank {r} was still running (stopped); its stacks:\n{_said(stacks[r])}" for r in running]
            if isinstance(ranks, LaunchedRanks):
                parts.append(f"{cfg.launcher}'s own output ends with:\n{_said(tail(ranks.launcher_log, lines=40))}")
            return "\n\n".join(parts)
        if all(c == 0 for c in codes):
            for event in results.read():  # anything written just before exit
                if event.get("event") == "row":
                    event.pop("event")
                    rows.append(Row.from_dict(event))
                elif event.get("event") == "done":
                    done = True
            return None if done else "the ranks exited before finishing the sweep:\n" + _said(ranks.tail(0, lines=60))
        if time.monotonic() > deadline:
            stacks = ranks.dump_stacks()
            ranks.stop()
            dumps = "\n\n".join(f"rank {r}:\n{_said(stacks[r] or ranks.tail(r, lines=40))}" for r in range(len(ranks)))
            return f"no progress while waiting for {waiting_for}; stopped every rank. Their stacks:\n{dumps}"
        if bar is not None:
            bar.tick()
        time.sleep(0.05)


def _human(nbytes: int) -> str:
    """``64 KiB`` for 65536, ``12 B`` for 12: binary units where the size is a whole number of them."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _said(text: str) -> str:
    return text.rstrip() or "(no output)"


# -- command line ----------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``pg-core``'s subparsers (``argparse``'s
    ``add_subparsers()`` result); it sets ``handler=main``."""
    parser = subparsers.add_parser(
        "bench",
        help="nccl-tests-style sweep of collectives, side by side with torch's Gloo and mpi4py",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(handler=main)


def _description() -> str:
    paragraphs = (
        "Time collectives over a range of sizes (--sizes, or nccl-tests' -b/-e/-f) on every pg-core backend named, "
        "in one run and one table, side by side with the raw libraries (torch's ProcessGroupGloo; mpi4py where "
        "mpiexec starts the ranks), check every result, and print min/median/max time, algbw and busbw per op and "
        "size, and each backend's median time relative to its baseline's. --plot draws latency and bus bandwidth "
        "against size.",
        "send_object and broadcast_object time pickled Python objects against torch's send_object_list and "
        "broadcast_object_list; send_tensor times a tensor whose shape the receiver does not know against torch's "
        "three send/recv steps, and against send_recv (a known shape) on the same backend.",
        "Times are per iteration, the slowest rank's. Compare the ratios measured side by side in one run, "
        "not absolute times across runs or machines. Exit status: 0 all correct, 1 a WRONG result or a failed "
        "rank, 2 bad arguments. The method in full: `python -m pydoc pg_core.bench`.",
        "--overhead measures something else: the core's own cost per call (ProcessGroup against the backend "
        "method it dispatches to), at world size 1 on a backend that does nothing; see its options below and "
        "`python -m pydoc pg_core.overhead`.",
    )
    return "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)


def _csv_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", "-n", type=int, default=2, metavar="N", help="rank processes to start (default 2)"
    )
    parser.add_argument(
        "--backends",
        default=None,
        metavar="LIST",
        help="comma-separated pg-core backends: names from `pg-core backends`, or module:attr / path/file.py:attr "
        "of a BackendSpec (or of a Backend subclass) not installed yet; '' for the baseline alone (default: every "
        "backend available for cpu)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not measure a baseline")
    parser.add_argument(
        "--baseline",
        default="auto",
        metavar="LIST",
        help=f"comma-separated baselines, measured in the same run: {BASELINE} (torch's ProcessGroupGloo) and "
        f"{MPI4PY} (raw mpi4py on numpy arrays; the ranks are then started by mpiexec). Each backend is compared "
        f"with the baseline of its own library (gloo with {BASELINE}, mpi with {MPI4PY}), others with the first. "
        f"Default 'auto': {BASELINE}, plus {MPI4PY} when mpiexec starts the ranks anyway (a backend such as mpi "
        "needs it) and mpi4py is installed",
    )
    parser.add_argument(
        "--ops",
        default="all",
        metavar="LIST",
        help=f"comma-separated, or 'all' (default): {', '.join(OPS)}; also the asynchronous forms "
        f"{', '.join(ASYNC_OPS.values())}, which 'all' leaves out (--async adds them)",
    )
    parser.add_argument(
        "--async",
        dest="async_forms",
        action="store_true",
        help="also measure each selected op that has one in its asynchronous form, right after it at each size "
        f"({', '.join(f'{a} after {b}' for b, a in ASYNC_OPS.items())}: async_op=True, or isend/irecv, then "
        "wait()); the 'vs' column gives the cost over the blocking call, as a ratio and in microseconds",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        metavar="LIST",
        help=f"comma-separated bytes per rank, K/M/G suffixes (default {DEFAULT_SIZES}); or sweep with -b/-e/-f",
    )
    lo, hi, f = DEFAULT_SWEEP
    parser.add_argument(
        "-b",
        "--minbytes",
        "--min-bytes",
        dest="min_bytes",
        default=None,
        metavar="SIZE",
        help=f"sweep from this size, as nccl-tests' -b (default {lo} when -e or -f is given)",
    )
    parser.add_argument(
        "-e",
        "--maxbytes",
        "--max-bytes",
        dest="max_bytes",
        default=None,
        metavar="SIZE",
        help=f"sweep up to this size, K/M/G suffixes, as nccl-tests' -e (default {hi})",
    )
    parser.add_argument(
        "-f",
        "--stepfactor",
        "--factor",
        dest="factor",
        default=None,
        metavar="F",
        help=f"multiply the size by F (> 1) from one step to the next, as nccl-tests' -f (default {f})",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="element type (default float32)")
    parser.add_argument(
        "--iters", type=int, default=200, metavar="N", help="most timed iterations per row (default 200)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, metavar="W", help="untimed iterations per row, at least 1 (default 5)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds per (backend, op, size); at least 5 timed iterations run regardless (default 2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="time each (op, size) in R rounds: every backend and baseline runs its share of the timed iterations "
        "in turn, R times over, so that a machine that slows down or speeds up during the run weighs on every "
        "row alike (default 1: one row after the other)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help=f"time each baseline a second time, as a row of its own (BASELINE{CONTROL}) compared with the first: "
        "the ratio of two rows doing the very same work, which is how far from 1.00x this run's noise alone puts "
        "a ratio (best with --rounds)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="seconds any one operation may take (default 60)"
    )
    parser.add_argument(
        "--pin-ranks",
        action="store_true",
        help="pin rank r to the r-th CPU this process may run on (modulo their number), as MPI's --bind-to core "
        "does: steadier times, where the scheduler's placement of the ranks would otherwise decide them (Linux)",
    )
    parser.add_argument(
        "--to-torch",
        action="store_true",
        help="also time each pg-core backend through its group's to_torch(), with torch's ProcessGroup API "
        "(rows labelled BACKEND.to_torch): pg-gloo's is Gloo itself, registered natively",
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as JSON instead of tables")
    fmt.add_argument("--csv", action="store_true", help="print the rows as CSV instead of tables")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also write a plot of median time and bus bandwidth against size, log-log, a line per backend and "
        "op, baselines dashed in their backend's colour (needs matplotlib)",
    )
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (otherwise a line per row, and a progress bar below them when stderr is a "
        "terminal)",
    )
    over = parser.add_argument_group(
        "core overhead (--overhead)",
        "Instead of the sweep: what the core adds per call, at world size 1 in this process, on a backend "
        "whose ops return at once. Per op (all_reduce, broadcast, reduce, all_gather_into_tensor, "
        "reduce_scatter_tensor, barrier; narrow with --ops): the backend method called directly, the same op "
        "through ProcessGroup blocking, and with async_op=True plus wait(); overhead = blocking - direct, the "
        "figure the target of at most 3 us per blocking collective is judged by. --dtype, --ops, --json and "
        "--csv apply; the sweep's other options do not.",
    )
    over.add_argument(
        "--overhead", action="store_true", help="measure the core's overhead per call instead of sweeping"
    )
    over.add_argument(
        "--overhead-iters",
        type=int,
        default=20_000,
        metavar="N",
        help="calls per timed batch (default 20000)",
    )
    over.add_argument(
        "--repeats",
        type=int,
        default=5,
        metavar="R",
        help="timed batches per op and mode; medians reported (default 5)",
    )


def _config(args: argparse.Namespace) -> _Config:
    n = args.world_size
    if n < 1:
        raise BenchError(f"--world-size must be >= 1, got {n}")
    if args.iters < 1:
        raise BenchError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {args.rounds}")
    if not args.time_budget > 0 or not args.timeout > 0:
        raise BenchError("--time-budget and --timeout must be positive")
    if args.pin_ranks and not hasattr(os, "sched_setaffinity"):
        raise BenchError("--pin-ranks needs os.sched_setaffinity, which this platform lacks (it is Linux's)")
    ops = list(OPS) if args.ops.strip() == "all" else list(dict.fromkeys(_csv_list(args.ops)))
    unknown = [op for op in ops if op not in KNOWN_OPS]
    if unknown or not ops:
        raise BenchError(f"--ops: unknown {', '.join(unknown) or 'nothing named'}; known: {', '.join(KNOWN_OPS)}")
    if args.async_forms:
        ops = list(dict.fromkeys(o for op in ops for o in (op, ASYNC_OPS.get(op)) if o is not None))
    try:
        sizes = requested_sizes(args.sizes, args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    backends, labels, launchers = _backends(args.backends)
    baselines = [] if args.no_baseline else _baselines(args.baseline, launchers)
    if MPI4PY in baselines:
        launchers.add("mpiexec")
    if len(launchers) > 1:
        raise BenchError(f"--backends: their ranks must be started by different launchers ({sorted(launchers)})")
    if not backends and not baselines:
        raise BenchError("nothing to measure: no pg-core backend named and no baseline")
    if args.control and not baselines:
        raise BenchError("--control times a baseline twice, and no baseline is measured (--no-baseline)")
    if len(set(labels)) != len(labels) or set(BASELINES) & set(labels) or any("/" in label for label in labels):
        raise BenchError(f"--backends: labels {labels} must be distinct, without '/', and none of {BASELINES}")
    return _Config(
        world_size=n,
        backends=backends,
        labels=labels,
        baselines=baselines,
        ops=ops,
        sizes=sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        time_budget=args.time_budget,
        timeout=args.timeout,
        pin_ranks=args.pin_ranks,
        to_torch=args.to_torch,
        control=args.control,
        rounds=args.rounds,
        launcher=next(iter(launchers), None),
    )


def _baselines(text: str, launchers: set[str]) -> list[str]:
    """``--baseline`` as the baselines to measure, in order; ``launchers``: those the backends
    measured need (``auto`` adds mpi4py where mpiexec starts the ranks anyway)."""
    import torch.distributed as dist

    gloo = dist.is_available() and dist.is_gloo_available()
    mpi4py = importlib.util.find_spec("mpi4py") is not None
    if text.strip() == "auto":
        return [BASELINE] * gloo + [MPI4PY] * (mpi4py and "mpiexec" in launchers)
    chosen = list(dict.fromkeys(_csv_list(text)))
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown or not chosen:
        raise BenchError(
            f"--baseline: unknown {', '.join(unknown) or 'nothing named'}; known: {', '.join(BASELINES)} "
            "(comma-separated), 'auto', or --no-baseline"
        )
    if BASELINE in chosen and not gloo:
        raise BenchError(f"this torch has no Gloo, so no {BASELINE} baseline; pass --no-baseline")
    if MPI4PY in chosen and not mpi4py:
        raise BenchError(f"--baseline {MPI4PY} needs mpi4py (pip install pg-mpi brings it); or pass --no-baseline")
    return chosen


def _backends(text: str | None) -> tuple[list[str], list[str], set[str]]:
    """``--backends`` as references and the labels of their rows, resolved here (with
    :func:`pg_core.registry.resolve_backend_ref`, as the ranks do), so a wrong one fails
    before any rank starts. A name's label is the name; a ``module:attr`` or
    ``file.py:attr`` one's, the name of the spec it resolves to. A backend whose spec declares
    a launcher is resolved where its ranks will run (``here=False``); the third value is the
    launchers the named backends declare."""
    from .errors import PGError
    from .registry import default_registry, resolve_backend_ref

    registry = default_registry()
    if text is None:
        specs = registry.available_for("cpu") + _launched_for("cpu", registry.entries())
        if not specs:
            try:
                registry.default_for("cpu")
            except PGError as exc:
                raise BenchError(f"{exc} Pass --backends '' to measure the {BASELINE} baseline alone.") from None
        specs.sort(key=lambda spec: (-spec.priority, spec.name))
        names = [spec.name for spec in specs]
        return names, list(names), {spec.launcher for spec in specs if spec.launcher is not None}
    refs = list(dict.fromkeys(_csv_list(text)))
    labels = []
    launchers: set[str] = set()
    for ref in refs:
        try:
            spec = resolve_backend_ref(ref, "cpu", registry=registry, here=False)
        except PGError as exc:
            raise BenchError(f"--backends: {exc}") from None
        labels.append(spec.name if ":" in ref else ref)
        if spec.launcher is not None:
            launchers.add(spec.launcher)
    return refs, labels, launchers


def _launched_for(device: str, entries: Sequence[PluginEntry]) -> list[BackendSpec]:
    """The backends for ``device`` that are unavailable here only because a launcher must start
    their ranks, and that are available in a process it starts (asked there: a second or two
    each); those of the first such launcher, since one run's ranks are started one way."""
    from .launchers import why_unavailable_launched

    found: list[BackendSpec] = []
    for entry in entries:
        spec = entry.spec
        if entry.status != "unavailable" or spec is None or spec.launcher is None or device not in spec.devices:
            continue
        if found and spec.launcher != found[0].launcher:
            continue
        if why_unavailable_launched(spec.name, spec.launcher) is None:
            found.append(spec)
    return found


def main(args: argparse.Namespace) -> int:
    """Run the benchmark as ``args`` (from :func:`add_parser`'s parser) say; return the exit status."""
    if args.overhead:
        return _overhead(args)
    try:
        cfg = _config(args)
        if args.plot:
            _require_matplotlib()
            folder = Path(args.plot).resolve().parent
            if not folder.is_dir():
                raise BenchError(f"--plot {args.plot}: the folder {folder} does not exist; create it or name another")
    except BenchError as exc:
        print(f"pg-core bench: {exc}", file=sys.stderr)
        return 2
    progress = None if args.quiet else sys.stderr
    try:
        outcome = _run_ranks(cfg, progress, bar=ProgressBar.wanted(sys.stderr, args.quiet))
    except KeyboardInterrupt:  # the ranks are stopped already
        print("pg-core bench: interrupted", file=sys.stderr)
        return 130
    rows = outcome.rows
    _add_ratios(rows)
    if args.json:
        print(format_json(rows))
    elif args.csv:
        print(format_csv(rows), end="")
    elif rows:
        from .registry import default_registry

        print(format_table(rows, describe_backends([r.backend for r in rows], default_registry().entries())))
    status = 0
    if args.plot and rows:
        try:
            write_plot(rows, args.plot)
        except BenchError as exc:
            print(f"pg-core bench: {exc}", file=sys.stderr)
            status = 2
        except OSError as exc:
            print(f"pg-core bench: --plot {args.plot}: cannot write it: {exc}", file=sys.stderr)
            status = 2
    wrong = [r for r in rows if r.status == "WRONG"]
    if wrong:
        print(f"pg-core bench: {len(wrong)} row(s) gave WRONG results:", file=sys.stderr)
        for r in wrong:
            print(f"  {r.backend} {r.op} {r.size} B: {r.detail}", file=sys.stderr)
        status = 1
    if outcome.failure is not None:
        print(f"pg-core bench: the run failed: {outcome.failure}", file=sys.stderr)
        status = 1
    return status


def _overhead(args: argparse.Namespace) -> int:
    """``--overhead``: :mod:`pg_core.overhead`, in this process."""
    from . import overhead

    ops = list(overhead.OPS) if args.ops.strip() == "all" else list(dict.fromkeys(_csv_list(args.ops)))
    unknown = [op for op in ops if op not in overhead.OPS]
    problem = None
    if unknown or not ops:
        problem = f"--ops: {', '.join(unknown) or 'nothing named'} not measured by --overhead; it measures {', '.join(overhead.OPS)}"
    elif args.overhead_iters < 1 or args.repeats < 1:
        problem = f"--overhead-iters and --repeats must be >= 1, got {args.overhead_iters} and {args.repeats}"
    elif args.backends is not None or args.plot:
        problem = "--overhead measures the core on a backend that does nothing; --backends and --plot do not apply"
    if problem is not None:
        print(f"pg-core bench: {problem}", file=sys.stderr)
        return 2
    progress = None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True)
    rows = overhead.measure(
        ops, iters=args.overhead_iters, repeats=args.repeats, dtype=DTYPES[args.dtype], progress=progress
    )
    if args.json:
        print(format_json(rows))
    elif args.csv:
        print(format_csv(rows, overhead.OverheadRow), end="")
    else:
        print(overhead.format_table(rows))
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_WORKER_FLAG]:
        return _worker_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m pg_core.bench",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli())
