"""Coverage: what every certification run exercises with values, whatever Hypothesis draws.

The drawn tests sample a backend's declaration; a backend that declares everything (every
op, dtype and reduce op) has hundreds of combinations, and sixteen drawn examples per op
reach few of them. The ``coverage`` test runs them all, deterministically, in batches of
calls on one group per example:

* **every declared combination** (op, device type, dtype, reduce op; ``send``/``recv`` as
  one ``p2p`` combination per dtype) twice: blocking at the smallest world size >= 2 with
  the comfortable values, and asynchronous at the largest with each dtype's whole range
  (:func:`~pg_core.testing.tensors.extreme_tensor`), each time with a piece size from
  :func:`sizes` (empty, one element, odd counts, just below and above powers of two);
* **every root** of ``broadcast``, ``reduce``, ``gather`` and ``scatter`` at every world size;
* **every odd one out**: at every world size >= 2, for every rank k, an ``all_to_all`` and
  an ``all_to_all_single`` in which k sends nothing, and one in which k receives nothing;
  point to point in which k sends to every other rank, and every other rank sends to k;
* **a piece past 4 MiB** for every declared op, where transports switch protocols;
* **buffer lifetime, order and tags** (:func:`lifetime_calls`): send buffers overwritten as
  soon as their ``isend`` completed, receives read as soon as their ``wait()`` returned,
  messages in flight on one (peer, tag) in quick succession, blocking and async mixed,
  user tags on both sides of 2**31 and 2**32 and at the top of the declared range while
  the core's own tags carry values and collectives;
* **receiving from any source** (:func:`any_source_calls`): where ``recv_anysource`` is
  declared, every dtype, and every rank as the receiver of every other rank's messages on
  two tags, received from any source and naming senders in turn; where it is not, a probe
  that it raises ``NotSupportedError`` and posts nothing.

Every example is an ordinary :class:`~pg_core.testing.cases.Example`, judged like any
other and printed with a replay line when it fails.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

import torch

from ..dtypes import dtype_name
from ..ops import COLLECTIVE_OPS, RedOpType
from .cases import EXTREME, VALUE_OPS, Call, Example, Lane, dtype_of
from .strategies import Target, any_source_plan, threshold_pieces

__all__ = [
    "BATCH",
    "HUGE_BYTES",
    "NOT_COVERED",
    "SIZE_CLASSES",
    "Exercised",
    "any_source_calls",
    "coverage_examples",
    "exercised_lines",
    "lifetime_calls",
    "note_exercised",
    "size_class",
    "sizes",
    "world_sizes",
]

#: Calls per example: enough to amortise forming a group, few enough that a failure reads.
BATCH = 24
#: The large piece of every op: past 4 MiB, by one element.
HUGE_BYTES = 4 * 1024 * 1024
_ROOTED = ("broadcast", "reduce", "gather", "scatter")


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
    layout: str = "contig",
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
    return Call(op, dtype_name(dtype), shape, layout, async_op, None, params)


def _p2p(
    dtype: torch.dtype,
    pairs: list[tuple[int, int]],
    shape: tuple[int, ...],
    tags: tuple[int, ...],
    *,
    async_op: bool,
    extreme: bool,
) -> Call:
    messages = [[src, dst, tags[m % len(tags)], list(shape), dtype_name(dtype)] for m, (src, dst) in enumerate(pairs)]
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


#: the collectives that reduce, whose fast paths for small tensors the size classes reach
_REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor")


def coverage_calls(target: Target, device: str) -> dict[int, list[Call]]:
    """Every coverage call on ``device``, by the world size it runs at."""
    first, second = world_sizes(target.world_sizes)
    top = max(target.tags(device))  # the highest user tag the backend carries (0: no tags)
    tags = tuple(dict.fromkeys(t for t in (0, 3, top) if t <= top))
    calls: dict[int, list[Call]] = {}
    for i, (op, dtype, kind) in enumerate(_combinations(target, device)):
        shapes = sizes(dtype)
        for n, async_op, extreme, shift in ((first, False, False, 0), (second, True, True, 3)):
            shape = shapes[(i + shift) % len(shapes)]
            if op == "p2p":
                if n < 2:
                    continue
                call = _p2p(dtype, _ring(n), shape, tags, async_op=async_op, extreme=extreme)
            else:
                layout = "bucket" if extreme else "contig"  # every declared kind also meets a view with sentinels
                call = _call(op, dtype, kind, n, shape, async_op=async_op, extreme=extreme, root=i % n, layout=layout)
            calls.setdefault(n, []).append(call)
    # Every declared (dtype, reduce op) of the reducing collectives at every size class with each
    # dtype's whole range: a fast path for 0-d, one-element or threshold-sized tensors meets the
    # values a slow path does (all_reduce at every class; the others at 0-d and one element).
    for op in _REDUCING:
        pieces: list[tuple[int, ...]] = [(), (1,)] if op != "all_reduce" else []
        for dtype, kind in target.declared(op, device):
            shapes_of = pieces or [(), (1,), (7,), *threshold_pieces(dtype, allow_large=False)]
            for shape in shapes_of:
                if op == "reduce_scatter_tensor" and not shape:
                    continue  # its input is n pieces: a 0-d piece has none
                calls.setdefault(second, []).append(
                    _call(op, dtype, kind, second, shape, async_op=False, extreme=True, root=0, layout="bucket")
                )
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
                calls[n].append(_p2p(p2p[k % len(p2p)], star, (4,), tags, async_op=k % 2 == 0, extreme=False))
    for n in target.world_sizes:
        if n >= 2:
            calls[n].extend(lifetime_calls(target, device, n))
    big = calls.setdefault(first, [])
    for op in (*COLLECTIVE_OPS, "p2p"):  # one piece past 4 MiB per op
        declared = [(d, None) for d in target.p2p_dtypes(device)] if op == "p2p" else target.declared(op, device)
        if not declared or op == "barrier":
            continue
        dtype, kind = declared[0]
        elements = HUGE_BYTES // torch.empty((), dtype=dtype).element_size() + 1
        if op == "p2p":
            if first >= 2:
                big.append(_p2p(dtype, [(0, first - 1)], (elements,), tags, async_op=False, extreme=False))
            continue
        splits = [[1] * first for _ in range(first)]
        big.append(
            _call(op, dtype, kind, first, (elements,), async_op=False, extreme=False, root=first - 1, splits=splits)
        )
    return calls


def lifetime_calls(target: Target, device: str, n: int) -> list[Call]:
    """Buffer lifetime, order and tags on a group of ``n`` >= 2 ranks:

    * ``overwrite``: every rank isends two messages to the next, waits, and overwrites its send
      buffers at once; the receivers receive afterwards and must get what was sent;
    * ``mixed``: eight messages each way between ranks 0 and 1 on one tag, sent and received
      blocking and async in turn (each async receive read as soon as its ``wait()`` returns);
    * tags: one message from rank 0 to rank 1 on each of :meth:`Target.tags` (both sides of
      2**31 and 2**32, the top of the declared range), received in the reverse order;
    * values, where they travel: objects, tensors of unknown shape and plain sends on the
      top user tag and on tag 0, three tensors in a row on one tag (each must stay as it
      arrived while the next ones come).
    """
    p2p = target.p2p_dtypes(device)
    if not p2p:
        return []
    dtype = torch.float32 if torch.float32 in p2p else p2p[0]
    name = dtype_name(dtype)
    out: list[Call] = []
    ring = [[r, (r + 1) % n, 0, [size], name] for r in range(n) for size in (1025, 2**14 + 1)]
    out.append(Call("p2p", params={"messages": ring, "mode": "overwrite", "recv_order": list(range(len(ring)))}))
    burst = [[src, 1 - src, 0, [size], name] for src in (0, 1) for size in (4, 1, 300, 0, 2**14 + 3, 5, 1, 7)]
    out.append(
        Call("p2p", async_op=True, params={"messages": burst, "mode": "mixed", "recv_order": list(range(len(burst)))})
    )
    tags = target.tags(device)
    if len(tags) > 1:
        tagged = [[0, 1, tag, [6], name] for tag in tags]
        params = {"messages": tagged, "mode": "async", "recv_order": list(range(len(tagged)))[::-1]}
        out.append(Call("p2p", async_op=True, params=params))
    if target.messages(device):
        top = tags[-1]
        tensor = ["tensor", name, [257], "contig", True]
        msgs = [
            [0, 1, top, "object", "recv_object", ["list", [["int", 2**70], ["str", "top"]]]],
            [0, 1, top, "tensor", "recv_tensor", tensor],
            [0, 1, top, "tensor", "recv_tensor", ["tensor", name, [3], "contig", False]],
            [0, 1, top, "tensor", "recv_tensor", ["tensor", name, [2**14 + 1], "contig", True]],
            [0, 1, top, "plain", "recv", ["tensor", name, [9], "contig", False]],
            [0, 1, 0, "object", "recv_object", ["dict", [[["str", "k"], tensor]]]],
            [1, 0, top, "tensor", "recv_tensor", tensor],
        ]
        params = {"messages": msgs, "mode": "blocking", "recv_order": list(range(len(msgs)))}
        out.append(Call("messages", params=params))
    return out


def _any_source(
    dtype: torch.dtype,
    n: int,
    receiver: int,
    shape: tuple[int, ...],
    tags: tuple[int, ...],
    *,
    async_op: bool,
    extreme: bool,
) -> Call:
    """Every rank but ``receiver`` sends it two messages, on ``tags`` in turn; the receiver takes
    them in the reverse of that listing, naming every other sender it can (blocking) or all
    from any source, posted at once (``async_op``)."""
    messages = [[src, tags[(src + k) % len(tags)]] for src in range(n) if src != receiver for k in range(2)]
    order = list(range(len(messages)))[::-1]
    plan = any_source_plan(messages, order, [not async_op and i % 2 == 0 for i in range(len(messages))])
    params: dict[str, object] = {
        "receiver": receiver,
        "messages": messages,
        "plan": plan,
        "mode": "async" if async_op else "blocking",
    }
    if extreme:
        params["values"] = EXTREME
    return Call("any_source", dtype_name(dtype), shape, "contig", async_op, None, params)


def any_source_calls(target: Target, device: str) -> dict[int, list[list[Call]]]:
    """Receives from any source on ``device``, by world size, in batches whose calls use tags of
    their own (a receive from any source of one call must not meet another call's messages).
    Declared: a receive from any source on a tag nobody sends on, which must time out; every
    dtype, blocking at the first world size and async with the whole range at the second; and
    every receiver at every world size >= 2. Not declared (where point to
    point is): a probe that ``recv(src=None)`` raises ``NotSupportedError`` and ``supports``
    says no, followed by a ring of sends that a receive posted anyway would take."""
    multi = [n for n in target.world_sizes if n >= 2]
    p2p = target.p2p_dtypes(device)
    if not multi or not p2p:
        return {}
    first, second = world_sizes(multi)
    dtypes = target.any_source(device)
    if not dtypes:
        params = {"target": "recv_anysource", "caller": 0, "reduce": None}
        probe = Call("undeclared", dtype_name(p2p[0]), (), "contig", False, None, params)
        ring = _p2p(p2p[0], _ring(first), (4,), (0,), async_op=False, extreme=False)
        return {first: [[probe, ring]]}
    top = max(target.tags(device))
    per_batch = max(1, min(BATCH, (top + 1) // 2))
    tags_of = [(2 * j, 2 * j + 1) if top > 0 else (0,) for j in range(per_batch)]
    made: dict[int, list[Call]] = {}

    def add(n: int, make: tuple[torch.dtype, int, tuple[int, ...], bool, bool]) -> None:
        dtype, receiver, shape, async_op, extreme = make
        batch = made.setdefault(n, [])
        tags = tags_of[len(batch) % per_batch]
        batch.append(_any_source(dtype, n, receiver, shape, tags, async_op=async_op, extreme=extreme))

    for i, dtype in enumerate(dtypes):
        shapes = sizes(dtype)
        add(first, (dtype, i % first, shapes[i % len(shapes)], False, False))
        add(second, (dtype, (i + 1) % second, shapes[(i + 3) % len(shapes)], True, True))
    for n in multi:
        for k in range(n):
            add(n, (dtypes[k % len(dtypes)], k, (4,), k % 2 == 1, False))
    batches = {n: [calls[i : i + per_batch] for i in range(0, len(calls), per_batch)] for n, calls in made.items()}
    # a timeout ends its caller's lane (the call raises): an example of its own
    params = {"target": "recv_anysource", "caller": first - 1, "peer": 0, "seconds": 0.5, "tag": 0}
    batches[first].append([Call("timeout", dtype_name(dtypes[0]), (), "contig", False, None, params)])
    return batches


def coverage_examples(target: Target) -> list[Example]:
    """The coverage test's examples: :func:`coverage_calls` on every device, :data:`BATCH`
    calls per example (asynchronous ones waited newest first), then :func:`any_source_calls`."""
    examples: list[Example] = []

    def add(n: int, device: str, chunk: list[Call]) -> None:
        waits = [i for i, c in enumerate(chunk) if c.async_op][::-1]
        examples.append(Example(n, device, len(examples), [Lane(list(range(n)), chunk, waits)]))

    for device in target.devices:
        for n, calls in sorted(coverage_calls(target, device).items()):
            for start in range(0, len(calls), BATCH):
                add(n, device, calls[start : start + BATCH])
        for n, batches in sorted(any_source_calls(target, device).items()):
            for batch in batches:
                add(n, device, batch)
    return examples


# -- what a run exercised, for its summary ------------------------------------------------------------------

#: The size classes of a piece, as the summary counts them, with the largest byte count of each.
SIZE_CLASSES: tuple[tuple[str, float], ...] = (
    ("small (<1 KiB)", 1024),
    ("medium (<64 KiB)", 64 * 1024),
    ("large (<=4 MiB)", HUGE_BYTES),
    ("past 4 MiB", float("inf")),
)
#: Size classes every piece falls in first: by shape, whatever its dtype.
_BY_SHAPE = ("0-d", "empty", "1 element")
#: Call kinds that move no tensor of their own: the summary counts them as probes.
_PROBES = ("undeclared", "bad_input", "timeout", "split", "new_group")


def size_class(shape: Sequence[int], dtype: str) -> str:
    """``"0-d"``, ``"empty"``, ``"1 element"``, or a class of :data:`SIZE_CLASSES` by bytes."""
    if len(shape) == 0:
        return "0-d"
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel == 0:
        return "empty"
    if numel == 1:
        return "1 element"
    nbytes = numel * torch.empty((), dtype=dtype_of(dtype)).element_size()
    return next(name for name, limit in SIZE_CLASSES if nbytes <= limit)


class Exercised:
    """What one test's passed examples exercised: the layouts of their buffers, the size
    classes and dtypes of their pieces, comfortable or extreme values, blocking or async
    calls (and how many had a late rank), and the probes they made."""

    def __init__(self) -> None:
        self.layouts: collections.Counter[str] = collections.Counter()
        self.sizes: collections.Counter[str] = collections.Counter()
        self.values: collections.Counter[str] = collections.Counter()
        self.modes: collections.Counter[str] = collections.Counter()
        self.probes: collections.Counter[str] = collections.Counter()
        self.dtypes: set[str] = set()

    def note(self, example: Example) -> None:
        for lane in example.lanes:
            for call in lane.calls:
                self._note_call(call)

    def _note_call(self, call: Call) -> None:
        if call.op in _PROBES:
            self.probes[call.op] += 1
            return
        self.modes["async" if call.async_op else "blocking"] += 1
        if call.late is not None:
            self.modes["late rank"] += 1
        if call.op in ("messages", *VALUE_OPS):
            self.values["values (objects, tensors of unknown shape, dicts)"] += 1
            return
        self.layouts[call.layout] += 1
        self.values["extreme" if call.params.get("values") == EXTREME else "comfortable"] += 1
        pieces: list[tuple[Sequence[int], str]] = [(call.shape, call.dtype)]
        if call.op == "p2p":
            pieces = [(m[3], m[4]) for m in call.params["messages"]]
        for shape, dtype in pieces:
            self.sizes[size_class(shape, dtype)] += 1
            if call.op != "barrier":
                self.dtypes.add(dtype)

    def line(self) -> str:
        """One line: every dimension with its counts; size classes never reached are named."""
        parts = []
        if self.layouts:
            parts.append("layouts " + _counts(self.layouts))
        if self.sizes:
            order = [*_BY_SHAPE, *(name for name, _ in SIZE_CLASSES)]
            missing = [s for s in order if s not in self.sizes]
            sizes = ", ".join(f"{s} {self.sizes[s]}" for s in order if s in self.sizes)
            parts.append(f"sizes {sizes}" + (f" (never: {', '.join(missing)})" if missing else ""))
        if self.dtypes:
            parts.append(f"{len(self.dtypes)} dtypes")
        if self.values:
            parts.append("values " + _counts(self.values))
        if self.modes:
            parts.append(_counts(self.modes))
        if self.probes:
            parts.append("probes " + _counts(self.probes))
        return "; ".join(parts)


def _counts(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{k} {c}" for k, c in counter.most_common())


def note_exercised(exercised: dict[str, Exercised], test: str, example: Example) -> None:
    """Count what a passed ``example`` of ``test`` exercised into ``exercised`` (per test)."""
    exercised.setdefault(test, Exercised()).note(example)


#: What no test of the suite checks; docs/conformance.md, "Not covered", says more.
NOT_COVERED = (
    "performance",
    "more than one host",
    "ranks calling different collectives (CollectiveMismatchError)",
    "pg_core.rendezvous",
    "any-source receives inside sequences, concurrent_groups and subgroups",
)


def exercised_lines(
    tests: Sequence[str],
    examples: collections.Counter[str],
    exercised: dict[str, Exercised],
    notes: dict[str, str],
) -> list[str]:
    """The summary's section on what each test exercised, in the order of ``tests``: the
    dimensions its passed examples reached (:class:`Exercised`), what a test that is not
    drawn measured (its note), the tests that ran nothing, and what the suite never checks."""
    lines = ["", "what each test exercised (passed examples)"]
    for test in tests:
        if test in exercised:
            lines.append(f"  {test}: {exercised[test].line()}")
        if test in notes:
            lines.append(f"  {test}: {notes[test]}")
    idle = [t for t in tests if not examples[t]]
    if idle:
        lines.append(f"  not run (not applicable, not selected, or failed before an example passed): {', '.join(idle)}")
    lines.append(f"  never checked by this suite: {'; '.join(NOT_COVERED)}")
    return lines
