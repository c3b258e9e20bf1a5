"""Sizes, counts and bandwidth: the command line's sizes and sweeps (nccl-tests' ``-b -e -f``),
the order (op, size) pairs are measured in, a buffer's element count, the bus bandwidth
factor, how many iterations fit the time budget, and the rotation of ``--rounds``."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Final, TypeVar

from .catalog import BLOCKING_OF, ECHO_OPS, KNOWN_OPS, OBJECT_OPS, REFERENCE_OPS, SPLIT_OPS

T = TypeVar("T")

__all__ = [
    "DEFAULT_SIZES",
    "DEFAULT_SWEEP",
    "MAX_SIZES",
    "MIN_ITERS",
    "busbw_factor",
    "csv_list",
    "element_count",
    "human_size",
    "parse_factor",
    "parse_size",
    "plan_iterations",
    "requested_sizes",
    "rotated",
    "sweep_batches",
    "sweep_sizes",
]

#: The sizes a run sweeps when the command line names none.
DEFAULT_SIZES: Final[str] = "4,1K,64K,1M,64M"
#: ``-b``, ``-e`` and ``-f`` where a sweep names only some of them.
DEFAULT_SWEEP: Final[tuple[str, str, str]] = ("4", "64M", "2")
#: The most sizes one sweep may have (a step factor barely above 1 would make millions).
MAX_SIZES: Final[int] = 1000
#: The fewest timed iterations a row has (unless ``--iters`` is smaller).
MIN_ITERS: Final[int] = 5
_UNITS: Final[dict[str, int]] = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``"4"``, ``"64K"``, ``"1M"``, ``"2G"`` (binary units; ``KB``/``KiB`` alike)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size: expected bytes such as 4, 64K, 1M or 2G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sweep_batches(ops: Sequence[str], sizes: Sequence[int]) -> list[list[tuple[str, int]]]:
    """(op, size) in the order they are measured, in batches: op by op, size by size, except
    that an op's reference op (:data:`~pg_core.bench.catalog.REFERENCE_OPS`), when selected
    too, and the ops that refer to it (its asynchronous form) are in its batch at each size.
    With ``--rounds``, a batch's rows are timed in the same rounds, so the ``vs`` ratio and
    difference compare blocks taken side by side, whatever the machine's speed drifts to from
    one batch to the next (the same calls timed in two batches one after the other have
    differed by 8% at 4 B)."""
    batches: list[list[tuple[str, int]]] = []
    seen: set[tuple[str, int]] = set()
    for op in ops:
        ref = REFERENCE_OPS.get(op)
        others = ([ref] if ref is not None and ref in ops else []) + [o for o in ops if REFERENCE_OPS.get(o) == op]
        for size in sizes:
            batch = [item for item in [(op, size)] + [(o, size) for o in others] if item not in seen]
            seen.update(batch)
            if batch:
                batches.append(batch)
    return batches


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
    listed = [parse_size(s) for s in csv_list(sizes or DEFAULT_SIZES)]
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
    if op in SPLIT_OPS:
        count = max(world_size, count // world_size * world_size)
    return count


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: ``busbw = algbw * factor``."""
    n = world_size
    op = BLOCKING_OF.get(op, op)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in SPLIT_OPS:
        return (n - 1) / n
    if op in ("broadcast", "reduce", *ECHO_OPS, *OBJECT_OPS):
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


def csv_list(text: str) -> list[str]:
    """The items of a comma-separated command-line list, stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def human_size(nbytes: int) -> str:
    """``64 KiB`` for 65536, ``12 B`` for 12: binary units where the size is a whole number of them."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
