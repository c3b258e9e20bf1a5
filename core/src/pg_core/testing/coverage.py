"""Coverage: what every certification run exercises with values, whatever Hypothesis draws.

The drawn tests sample a backend's declaration; a backend that declares everything (every
op, dtype and reduce op) has hundreds of combinations, and sixteen drawn examples per op
reach few of them. The ``coverage`` test runs them all, deterministically, in batches of
calls on one group per example:

* **every declared combination** (op, device type, dtype, reduce op; ``send``/``recv`` as
  one ``p2p`` combination per dtype) twice: blocking at the smallest world size >= 2 with
  the comfortable values, and asynchronous at the largest with each dtype's whole range
  (:func:`~pg_core.testing.cases.extreme_tensor`), each time with a piece size from
  :func:`sizes` (empty, one element, odd counts, just below and above powers of two);
* **every root** of ``broadcast``, ``reduce``, ``gather`` and ``scatter`` at every world size;
* **every odd one out**: at every world size >= 2, for every rank k, an ``all_to_all`` and
  an ``all_to_all_single`` in which k sends nothing, and one in which k receives nothing;
  point to point in which k sends to every other rank, and every other rank sends to k;
* **a piece past 4 MiB** for every declared op, where transports switch protocols.

Every example is an ordinary :class:`~pg_core.testing.cases.Example`, judged like any
other and printed with a replay line when it fails.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..ops import COLLECTIVE_OPS, RedOpType
from .cases import EXTREME, Call, Example, Lane, dtype_name
from .strategies import Target

__all__ = ["BATCH", "HUGE_BYTES", "coverage_examples", "sizes", "world_sizes"]

#: Calls per example: enough to amortise forming a group, few enough that a failure reads.
BATCH = 24
#: The large piece of every op: past 4 MiB, by one element.
HUGE_BYTES = 4 * 1024 * 1024
_ROOTED = ("broadcast", "reduce", "gather", "scatter")
_TAGS = (0, 3, 2**40)


def sizes(dtype: torch.dtype) -> list[tuple[int, ...]]:
    """The piece shapes the combinations cycle through: 0-d, empty, one element, odd
    counts, and byte counts just below and above 1 KiB, 4 KiB and 64 KiB (where small-message
    paths, eager buffers and socket reads change), and one 2-d piece."""
    item = torch.empty((), dtype=dtype).element_size()
    shapes: list[tuple[int, ...]] = [(1,), (), (0,), (7,), (3, 5)]
    for power in (10, 12, 16):
        shapes += [(2**power // item - 1,), (2**power // item + 1,)]
    return shapes


def world_sizes(all_sizes: Sequence[int]) -> tuple[int, int]:
    """The two world sizes every combination runs at: blocking at the first, async at the
    second (the smallest >= 2 and the largest, when there are two such)."""
    multi = [n for n in all_sizes if n >= 2]
    first = multi[0] if multi else all_sizes[0]
    others = [n for n in all_sizes if n != first]
    second = max(others) if others else first
    return first, second


def _call(
    op: str,
    dtype: torch.dtype,
    kind: RedOpType | None,
    n: int,
    shape: tuple[int, ...],
    *,
    async_op: bool,
    extreme: bool,
    root: int = 0,
    splits: list[list[int]] | None = None,
) -> Call:
    params: dict[str, object] = {}
    if kind is not None:
        params["reduce"] = kind.name
        if kind == RedOpType.PREMUL_SUM:
            params["factor"] = -1.5
    if extreme:
        params["values"] = EXTREME
    if op in _ROOTED:
        params["root"] = root
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        params["out_form"] = "stack"
    if op in ("all_to_all", "all_to_all_single"):
        params["splits"] = splits if splits is not None else [[(i + j) % 3 for j in range(n)] for i in range(n)]
        shape = shape[-1:]  # a row of the piece's last dimension; rows per pair from the splits
    if op == "barrier":
        shape = ()
    return Call(op, dtype_name(dtype), shape, "contig", async_op, None, params)


def _p2p(
    dtype: torch.dtype, pairs: list[tuple[int, int]], shape: tuple[int, ...], *, async_op: bool, extreme: bool
) -> Call:
    messages = [[src, dst, _TAGS[m % len(_TAGS)], list(shape), dtype_name(dtype)] for m, (src, dst) in enumerate(pairs)]
    params: dict[str, object] = {
        "messages": messages,
        "mode": "async" if async_op else "blocking",
        "recv_order": list(range(len(messages)))[::-1] if async_op else list(range(len(messages))),
    }
    if extreme:
        params["values"] = EXTREME
    return Call("p2p", "float32", (), "contig", async_op, None, params)


def _ring(n: int) -> list[tuple[int, int]]:
    return [(r, (r + 1) % n) for r in range(n)] if n > 1 else []


def _combinations(target: Target, device: str) -> Iterator[tuple[str, torch.dtype, RedOpType | None]]:
    for op in COLLECTIVE_OPS:
        for dtype, kind in target.declared(op, device):
            yield op, dtype, kind
    for dtype in target.p2p_dtypes(device):
        yield "p2p", dtype, None


def coverage_calls(target: Target, device: str) -> dict[int, list[Call]]:
    """Every coverage call on ``device``, by the world size it runs at."""
    first, second = world_sizes(target.world_sizes)
    calls: dict[int, list[Call]] = {}
    for i, (op, dtype, kind) in enumerate(_combinations(target, device)):
        shapes = sizes(dtype)
        for n, async_op, extreme, shift in ((first, False, False, 0), (second, True, True, 3)):
            shape = shapes[(i + shift) % len(shapes)]
            if op == "p2p":
                if n < 2:
                    continue
                call = _p2p(dtype, _ring(n), shape, async_op=async_op, extreme=extreme)
            else:
                call = _call(op, dtype, kind, n, shape, async_op=async_op, extreme=extreme, root=i % n)
            calls.setdefault(n, []).append(call)
    for n in target.world_sizes:  # every root, every odd one out
        for op in _ROOTED:
            declared = target.declared(op, device)
            for root in range(n) if declared else ():
                dtype, kind = declared[root % len(declared)]
                calls.setdefault(n, []).append(
                    _call(op, dtype, kind, n, (5,), async_op=root % 2 == 1, extreme=False, root=root)
                )
        if n < 2:
            continue
        for k in range(n):
            quiet = [[0 if i == k else 1 + (i + j) % 2 for j in range(n)] for i in range(n)]  # k sends nothing
            deaf = [[0 if j == k else 1 + (i + j) % 2 for j in range(n)] for i in range(n)]  # k receives nothing
            for op in ("all_to_all", "all_to_all_single"):
                declared = target.declared(op, device)
                if declared:
                    dtype, kind = declared[k % len(declared)]
                    for splits in (quiet, deaf):
                        calls[n].append(_call(op, dtype, kind, n, (3,), async_op=False, extreme=False, splits=splits))
            p2p = target.p2p_dtypes(device)
            if p2p:
                star = [(k, j) for j in range(n) if j != k] + [(j, k) for j in range(n) if j != k]
                calls[n].append(_p2p(p2p[k % len(p2p)], star, (4,), async_op=k % 2 == 0, extreme=False))
    big = calls.setdefault(first, [])
    for op in (*COLLECTIVE_OPS, "p2p"):  # one piece past 4 MiB per op
        declared = [(d, None) for d in target.p2p_dtypes(device)] if op == "p2p" else target.declared(op, device)
        if not declared or op == "barrier":
            continue
        dtype, kind = declared[0]
        elements = HUGE_BYTES // torch.empty((), dtype=dtype).element_size() + 1
        if op == "p2p":
            if first >= 2:
                big.append(_p2p(dtype, [(0, first - 1)], (elements,), async_op=False, extreme=False))
            continue
        splits = [[1] * first for _ in range(first)]
        big.append(
            _call(op, dtype, kind, first, (elements,), async_op=False, extreme=False, root=first - 1, splits=splits)
        )
    return calls


def coverage_examples(target: Target) -> list[Example]:
    """The coverage test's examples: :func:`coverage_calls` on every device, :data:`BATCH`
    calls per example (asynchronous ones waited newest first)."""
    examples: list[Example] = []
    for device in target.devices:
        for n, calls in sorted(coverage_calls(target, device).items()):
            for start in range(0, len(calls), BATCH):
                chunk = calls[start : start + BATCH]
                waits = [i for i, c in enumerate(chunk) if c.async_op][::-1]
                seed = len(examples)
                examples.append(Example(n, device, seed, [Lane(list(range(n)), chunk, waits)]))
    return examples
