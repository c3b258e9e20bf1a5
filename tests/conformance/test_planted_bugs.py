"""The conformance suite against planted bugs: it must catch every one, with the right check.

Each bug of ``planted.py`` (pg-tcp with one realistic mistake) runs only the conformance test meant to
catch it, and must fail it with the check that names the mistake. The example it fails on must then pass
on the unmodified backend under the same declaration (so the failure is the bug's, not the harness's),
and the controls run the same conformance tests, with the same draws, on the unmodified backend: they
must pass, so none of these tests can pass by a harness that fails everything.

Examples are derandomized (every run draws the same ones) and most runs skip shrinking: the suite only
has to report the bug. Three keep it, and must shrink to the world size where the bug first shows.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from pg_core.testing.cases import Example
from pg_core.testing.harness import PROFILES, Conformance, ConformanceFailure, Profile

PLANTED = Path(__file__).resolve().with_name("planted.py")

#: Small and derandomized; a short op timeout, so a timeout probe or a hang costs little.
PROFILE = Profile("planted", max_examples=12, derandomize=True, op_timeout=5.0, deadline=20.0, max_hangs=1)

#: Examples per conformance test (bug runs stop at the first failure; controls run them all).
EXAMPLES = {
    "all_reduce": 25,
    "p2p": 30,
    "any_source": 16,
    "timeouts": 6,
    "barrier": 2,
    "objects": 20,
    "unknown_shape": 25,
    "subgroups": 20,
    "coalescing": 12,
}

ALL_SIZES = (1, 2, 3, 4)
PEERS = (2, 3)  # values: a message needs two ranks


def ref(attr: str) -> str:
    return f"{PLANTED}:{attr}"


@dataclass(frozen=True)
class Bug:
    spec: str  # the BackendSpec in planted.py
    test: str  # the conformance test that must catch it
    checks: tuple[str, ...]  # the check that must report it (two where either legitimately does)
    control: str = "CONTROL"  # the unmodified backend under the same declaration
    world_sizes: tuple[int, ...] = ALL_SIZES
    shrink_to: int | None = None  # shrink, and expect this world size


BUGS = {
    "broadcast-wrong-root": Bug("BROADCAST_WRONG_ROOT", "broadcast", ("reference",), shrink_to=2),
    "all-gather-ring-block": Bug("ALL_GATHER_RING_BLOCK", "all_gather_into_tensor", ("reference",), shrink_to=3),
    "avg-wrong-count": Bug("AVG_WRONG_COUNT", "all_reduce", ("reference",), "CONTROL_FLOAT_REDUCE"),
    "float64-as-float32": Bug("FLOAT64_AS_FLOAT32", "all_reduce", ("reference",), "CONTROL_FLOAT_REDUCE"),
    # a message matched to the wrong receive: wrong data, or a size/dtype mismatch that fails the receive
    "tags-ignored": Bug("TAGS_IGNORED", "p2p", ("reference", "declared-must-pass"), "CONTROL_P2P"),
    "barrier-no-wait": Bug("BARRIER_NO_WAIT", "timeouts", ("timeout",), "CONTROL_BARRIER"),
    "rank-order-sum": Bug("RANK_ORDER_SUM", "all_reduce", ("ranks-agree",), "CONTROL_FLOAT_REDUCE"),
    "complex128-p2p-raises": Bug("COMPLEX128_P2P_RAISES", "p2p", ("declared-must-pass",), "CONTROL_P2P"),
    "irecv-early": Bug("IRECV_EARLY", "p2p", ("early-completion",), "CONTROL_P2P"),
    "scatter-reversed": Bug("SCATTER_REVERSED", "scatter", ("reference",)),
    # uneven splits cut evenly: wrong rows, or pieces whose sizes do not match (the call fails)
    "a2a-single-even-splits": Bug("A2A_SINGLE_EVEN_SPLITS", "all_to_all_single", ("reference", "declared-must-pass")),
    "stale-accumulator": Bug("STALE_ACCUMULATOR", "sequences", ("reference",), "CONTROL_ALL_REDUCE_SUM"),
    "premul-factor-ignored": Bug("PREMUL_FACTOR_IGNORED", "all_reduce", ("reference",), "CONTROL_FLOAT_REDUCE"),
    "int-min-max-swapped": Bug("INT_MIN_MAX_SWAPPED", "all_reduce", ("reference",), "CONTROL_INT_MIN_MAX"),
    "leaked-thread": Bug("LEAKED_THREAD", "barrier", ("leak",), world_sizes=(1,)),
    "all-gather-zeroes-input": Bug("ALL_GATHER_ZEROES_INPUT", "all_gather", ("inputs-unchanged",)),
    "recv-swallows-timeout": Bug("RECV_SWALLOWS_TIMEOUT", "timeouts", ("timeout",), "CONTROL_P2P"),
    "barrier-hides-peer-failure": Bug("BARRIER_HIDES_PEER_FAILURE", "dead_peer", ("dead-peer",), world_sizes=(2,)),
    "reduce-scatter-next-block": Bug("REDUCE_SCATTER_NEXT_BLOCK", "reduce_scatter_tensor", ("reference",)),
    # values: objects, tensors of unknown shape, tensor dicts, subgroups
    # a message of only its head: the receiver cannot parse it
    "send-bytes-first-part-only": Bug(
        "SEND_BYTES_FIRST_PART_ONLY", "objects", ("declared-must-pass",), world_sizes=PEERS, shrink_to=2
    ),
    "recv-bytes-short-read": Bug(
        "RECV_BYTES_SHORT_READ", "unknown_shape", ("reference",), "CONTROL_MESSAGES", world_sizes=PEERS
    ),
    # a message taken by the wrong receive: another value, or another kind of value (the receive fails); two
    # ranks, so that messages of one pair on different tags, received in another order, are common
    "bytes-tags-ignored": Bug(
        "BYTES_TAGS_IGNORED", "objects", ("reference", "declared-must-pass"), "CONTROL_MESSAGES", world_sizes=(2,)
    ),
    # the caller's tensors are zeroed; and a part sent twice (the root of a broadcast's tree sends one message to
    # several children) goes out zeroed the second time, which the receiver cannot parse
    "send-bytes-scrubs-parts": Bug(
        "SEND_BYTES_SCRUBS_PARTS",
        "unknown_shape",
        ("inputs-unchanged", "declared-must-pass"),
        "CONTROL_MESSAGES",
        world_sizes=PEERS,
    ),
    "emulated-recv-short-read": Bug(
        "EMULATED_RECV_SHORT_READ", "unknown_shape", ("reference",), "CONTROL_EMULATED", world_sizes=PEERS
    ),
    # ranks whose other groups ran different numbers of collectives disagree: pg-tcp sees the mismatch
    "process-wide-sequence": Bug("PROCESS_WIDE_SEQUENCE", "subgroups", ("declared-must-pass",)),
    # declared with pg-tcp's full capabilities: the coverage test runs every combination, the whole range of
    # every dtype, sizes across thresholds, every root and every odd one out
    "bfloat16-via-float16": Bug("BFLOAT16_VIA_FLOAT16", "coverage", ("reference",)),
    "int64-via-float64": Bug("INT64_VIA_FLOAT64", "coverage", ("reference",)),
    "uint8-as-int8": Bug("UINT8_AS_INT8", "coverage", ("reference",)),
    "saturating-int-sum": Bug("SATURATING_INT_SUM", "coverage", ("reference",)),
    "zero-start-sum": Bug("ZERO_START_SUM", "coverage", ("reference",)),
    "nan-as-zero-sum": Bug("NAN_AS_ZERO_SUM", "coverage", ("reference",)),
    "complex-product-elementwise": Bug("COMPLEX_PRODUCT_ELEMENTWISE", "coverage", ("reference",)),
    "broadcast-last-chunk-dropped": Bug("BROADCAST_LAST_CHUNK_DROPPED", "coverage", ("reference",)),
    "odd-bytes-dropped": Bug("ODD_BYTES_DROPPED", "coverage", ("reference",)),
    "last-root-reduce": Bug("LAST_ROOT_REDUCE", "coverage", ("reference",)),
    # the quiet rank's outputs stay as they were, or what it never received meets its next call there
    "a2a-quiet-rank-skips": Bug("A2A_QUIET_RANK_SKIPS", "coverage", ("reference", "declared-must-pass")),
    # errors and resources, with the full declaration too
    "timeout-from-group": Bug("TIMEOUT_FROM_GROUP", "timeouts", ("timeout",)),
    "cached-wakeup-pipe": Bug("CACHED_WAKEUP_PIPE", "coverage", ("leak",)),
    "helper-process-left": Bug("HELPER_PROCESS_LEFT", "coverage", ("leak",)),
    # a recv blocked on another thread is not woken by abort(): it raises CollectiveTimeout at its own timeout
    "abort-leaves-receives": Bug("ABORT_LEAVES_RECEIVES", "liveness", ("liveness",), world_sizes=(2,)),
    "cached-shared-memory": Bug("CACHED_SHARED_MEMORY", "barrier", ("leak",), world_sizes=(1,)),
    # buffer lifetime, order and tags, with the full declaration too
    # (the late data is read as overwritten values, or, when a later send on the stream overtakes it,
    # the receiver sees the wrong message: a CollectiveMismatchError, which fails the call)
    "isend-completes-early": Bug("ISEND_COMPLETES_EARLY", "coverage", ("reference", "declared-must-pass")),
    "irecv-fills-late": Bug("IRECV_FILLS_LATE", "coverage", ("reference",)),
    "tags-truncated-32": Bug("TAGS_TRUNCATED_32", "coverage", ("reference",)),
    "recv-bytes-shared-buffer": Bug("RECV_BYTES_SHARED_BUFFER", "coverage", ("reference",)),
    # the core refuses a read-only buffer from recv_bytes: the receive fails, naming the backend
    "recv-bytes-read-only": Bug("RECV_BYTES_READ_ONLY", "coverage", ("declared-must-pass",)),
    # coalescing: a call left out of the batch leaves its outputs as they were, or a receive waiting for a send
    # that never went (the batch fails)
    "coalesced-skips-last": Bug(
        "COALESCED_SKIPS_LAST", "coalescing", ("reference", "declared-must-pass"), "COALESCING", world_sizes=PEERS
    ),
    # receiving from any source, with the full declaration: a wrong sender (the core refuses this rank's own
    # rank, naming the backend), or a message lost to a stale receive (a later one in its place, or a timeout)
    "any-source-peer-index": Bug("ANY_SOURCE_PEER_INDEX", "any_source", ("reference", "declared-must-pass")),
    "any-source-irecv-per-peer": Bug("ANY_SOURCE_IRECV_PER_PEER", "any_source", ("reference", "declared-must-pass")),
    # a valid rank, another sender's: the receive holds a message that rank did not send there
    "any-source-stale-sender": Bug("ANY_SOURCE_STALE_SENDER", "any_source", ("reference",)),
    # layouts users pass and values at every size, with the full declaration: the neighbours of a bucket view
    # change, or its receiver gets another parameter's bytes; a one-element result loses its low bits
    "bucket-whole-storage": Bug("BUCKET_WHOLE_STORAGE", "all_reduce", ("reference",)),
    "send-from-storage-start": Bug("SEND_FROM_STORAGE_START", "p2p", ("reference",)),
    "one-element-via-float32": Bug("ONE_ELEMENT_VIA_FLOAT32", "coverage", ("reference",)),
    # a receive meeting a message it did not expect, and byte messages at their edges, with the full declaration
    "recv-zero-pads": Bug("RECV_ZERO_PADS", "receives", ("receive-mismatch",), world_sizes=(2,)),
    "send-bytes-drops-last-byte": Bug("SEND_BYTES_DROPS_LAST_BYTE", "receives", ("byte-messages",), world_sizes=(2,)),
    "send-bytes-stops-at-empty-part": Bug(
        "SEND_BYTES_STOPS_AT_EMPTY_PART", "receives", ("byte-messages",), world_sizes=(2,)
    ),
    # both sides of the eager limit: a send at most the declared limit that waits for its receiver; an isend whose
    # work completes before the tensor was read (the receiver gets what the caller wrote afterwards)
    "eager-limit-overstated": Bug("EAGER_LIMIT_OVERSTATED", "eager_limit", ("eager-limit",), "RENDEZVOUS", (2,)),
    "isend-queued-no-copy": Bug("ISEND_QUEUED_NO_COPY", "eager_limit", ("reference",), world_sizes=(2,)),
}

#: The conformance runs of the controls: every (declaration, test, world sizes) a bug above runs.
CONTROLS = sorted({(bug.control, bug.test, bug.world_sizes) for bug in BUGS.values()})


def suite(attr: str, world_sizes: tuple[int, ...], test: str, pools, *, shrink: bool = False) -> Conformance:
    return Conformance(
        ref(attr),
        world_sizes=world_sizes,
        profile=PROFILE,
        max_examples=EXAMPLES.get(test),
        pools=pools,
        shrink=shrink,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_is_caught(name: str, rank_pools) -> None:
    bug = BUGS[name]
    buggy = suite(bug.spec, bug.world_sizes, bug.test, rank_pools, shrink=bug.shrink_to is not None)
    with pytest.raises(ConformanceFailure) as caught:
        buggy.check(bug.test)
    failure = caught.value
    assert failure.check in bug.checks, f"{name}: caught by {failure.check!r}, expected {bug.checks}:\n{failure}"

    control = suite(bug.control, bug.world_sizes, bug.test, rank_pools)
    if failure.example is None:  # dead_peer is not drawn: the whole check must pass on the control
        control.check(bug.test)
        return
    # the failure names its example and a command that replays exactly that one
    assert failure.replay is not None
    assert f"--replay {bug.test} " in failure.replay and failure.replay in str(failure)
    assert Example.from_json(shlex.split(failure.replay)[-1]) == failure.example
    if bug.shrink_to is not None:
        assert failure.example.world_size == bug.shrink_to, failure.example.describe()
    # the example that caught the bug passes on the unmodified backend
    control.execute(bug.test, failure.example)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("control", "test", "world_sizes"), CONTROLS, ids=[f"{c}-{t}" for c, t, _ in CONTROLS])
def test_control_passes(control: str, test: str, world_sizes: tuple[int, ...], rank_pools) -> None:
    """The unmodified backend, declared as the bugs are, passes the same conformance runs."""
    checker = suite(control, world_sizes, test, rank_pools)
    checker.check(test)
    assert checker.examples[test] >= 1


@pytest.mark.timeout(120)
def test_summary_says_what_each_test_exercised(rank_pools) -> None:
    """The summary lists, per test, what its passed examples reached and what a test that is not drawn
    measured (liveness: how soon each blocked operation woke), and names the tests that ran nothing."""
    checker = Conformance(ref("CONTROL"), world_sizes=(1, 2), profile=PROFILE, max_examples=6, pools=rank_pools)
    checker.check("all_reduce")
    checker.check("liveness")
    text = checker.summary()
    line = next(row for row in text.splitlines() if row.startswith("  all_reduce: "))
    assert "layouts " in line and "sizes " in line and "dtypes" in line and "blocking " in line, text
    assert "  liveness: cpu: abort: recv woke in " in text and "barrier woke in " in text, text
    # pg-tcp's blocking send never waits (eager_limit_bytes=None): it takes 32 MiB in, and the summary says so
    assert "send 32 MiB to a stopped peer: completed before abort (the backend took it all in)" in text, text
    idle = next(row for row in text.splitlines() if row.startswith("  not run"))
    assert "broadcast" in idle and "all_reduce" not in idle.split(":", 1)[1], text


@pytest.mark.timeout(120)
def test_state_is_invisible_to_single_calls(rank_pools) -> None:
    """The stale accumulator passes every single-call example: only a sequence of calls can catch it."""
    single = suite("STALE_ACCUMULATOR", ALL_SIZES, "all_reduce", rank_pools)
    single.check("all_reduce")
    assert single.examples["all_reduce"] >= EXAMPLES["all_reduce"] // 2  # it did run, many times


@pytest.mark.timeout(240)
def test_hang_is_cut_off_with_stacks_and_the_suite_goes_on(rank_pools) -> None:
    """A barrier that ignores its timeout at world size 3: the example is cut off at its deadline, the
    failure carries every rank's stacks, and the pool serves the next check."""
    profile = Profile("planted-hang", max_examples=3, derandomize=True, op_timeout=2.0, deadline=6.0, max_hangs=1)
    hung = Conformance(ref("BARRIER_HANGS_AT_3"), world_sizes=(3,), profile=profile, pools=rank_pools, shrink=False)
    with pytest.raises(ConformanceFailure) as caught:
        hung.check("barrier")
    failure = caught.value
    text = str(failure)
    assert failure.check == "deadline", text
    assert failure.example is not None and failure.example.world_size == 3
    for rank in range(3):
        assert f"=== rank {rank}: did not finish" in text, text
    assert "File " in text and "planted.py" in text and "in barrier" in text, text  # the stuck frame is named

    control = Conformance(ref("CONTROL"), world_sizes=(3,), profile=profile, pools=rank_pools, shrink=False)
    control.check("barrier")
    assert control.examples["barrier"] >= 1


def _split_results(formed: dict[int, object]) -> list[dict[str, object]]:
    """What three ranks report for one split (lane 0) and its empty subgroup (lane 1)."""

    def record(rank: int) -> dict[str, object]:
        return {"call": 0, "error": None, "early": None, "supports": None, "formed": formed[rank]}

    lanes = {r: {0: [record(r)]} for r in range(3)}
    for r in (0, 1):
        lanes[r][1] = []
    return [{"lanes": lanes[r]} for r in range(3)]


def test_membership_is_judged_against_mpi_split() -> None:
    """No backend can get ``split`` wrong (pg-core forms subgroups), so the ``membership`` check is proved
    on what ranks report: the ranks of one color are ordered by key, then by parent rank."""
    from pg_core.testing.cases import Call, Lane

    split = Call("split", params={"colors": [1, 1, None], "keys": [1, 0, 0], "lanes": [[1, 1]], "name": None})
    example = Example(3, "cpu", 0, [Lane([0, 1, 2], [split]), Lane([1, 0], [], parent=0)])
    assert Example.from_json(example.to_json()) == example
    checker = Conformance(ref("CONTROL"), world_sizes=(3,), profile=PROFILE)
    right = {0: {"rank": 1, "size": 2, "parent_ranks": [1, 0]}, 1: {"rank": 0, "size": 2, "parent_ranks": [1, 0]}}
    checker.judge("subgroups", example, _split_results({**right, 2: None}))

    by_parent_rank = {
        0: {"rank": 0, "size": 2, "parent_ranks": [0, 1]},
        1: {"rank": 1, "size": 2, "parent_ranks": [0, 1]},
    }
    cases = [
        ({**by_parent_rank, 2: None}, "rank 0 called split(color=1, key=1) and got rank 0 of 2"),
        ({**right, 2: {"rank": 0, "size": 1, "parent_ranks": [2]}}, "expected None (no subgroup)"),
    ]
    for wrong, said in cases:
        with pytest.raises(ConformanceFailure) as caught:
            checker.judge("subgroups", example, _split_results(wrong))
        assert caught.value.check == "membership", str(caught.value)
        assert said in str(caught.value), str(caught.value)


TRUNCATING = Path(__file__).resolve().with_name("truncating.py")


@pytest.mark.timeout(240)
def test_truncating_backend_from_scratch_is_caught(rank_pools) -> None:
    """A backend written from scratch (not pg-tcp), whose recv cuts or zero-pads a message of another size
    to fit its tensor, is caught by the default run's receives test; pg-tcp under the same declaration
    passes it."""
    buggy = Conformance(f"{TRUNCATING}:SPEC", profile=PROFILES["ci"], pools=rank_pools, shrink=False)
    control = Conformance(ref("CONTROL_MESSAGES"), profile=PROFILES["ci"], pools=rank_pools, shrink=False)
    assert buggy.caps == control.caps  # the control is pg-tcp under the same declaration
    with pytest.raises(ConformanceFailure) as caught:
        buggy.check("receives")
    assert caught.value.check == "receive-mismatch", str(caught.value)
    assert "it returned normally" in caught.value.detail and "zero-padded" in caught.value.detail, caught.value.detail

    control.check("receives")
    assert control.examples["receives"] >= 1


def _mismatch_records(plan, buffer, error, *, follow: bool) -> list[list[dict[str, object]]]:
    """What ranks 0 and 1 report for every case of ``plan``: rank 1's buffer made by ``buffer(k, case)``,
    its error ``error`` (a class name, or None), and the right-sized message after it where ``follow``."""
    import torch
    from pg_core.testing.cases import dtype_of
    from pg_core.testing.receives import _bytes_of, _filled

    def mro(name: str | None) -> dict[str, object] | None:
        if name is None:
            return None
        return {"type": name, "mro": [name, "PGError", "RuntimeError", "Exception"], "message": "refused"}

    sender = [{"error": None, "follow_error": None} for _ in plan]
    receiver = []
    for k, m in enumerate(plan):
        rec: dict[str, object] = {"error": mro(error), "follow_error": None, "buffer": buffer(k, m)}
        if follow:
            rec["follow"] = _bytes_of(_filled(dtype_of(m.into[0]), m.into[1], k + 5000))
        receiver.append(rec)
    assert all(isinstance(r["buffer"], torch.Tensor) for r in receiver)
    return [sender, receiver]


def test_mismatched_receives_are_judged_as_the_contract_says() -> None:
    """The receive-mismatch rules, on what ranks report: a refusal with the buffer as it was, or holding the
    message's bytes at their offsets (a zero-copy receive), passes; a receive that returns, or a buffer
    zero-padded, fails; a backend declaring checks_message_size=False may time out instead."""
    import torch
    from pg_core.testing.cases import dtype_of
    from pg_core.testing.receives import _bytes_of, _filled, _judge_mismatches, mismatch_plan

    plan = mismatch_plan([torch.float32, torch.int32], any_source=False)
    assert {m.case for m in plan} >= {"one element short", "one element long", "an empty message"}

    def before(k: int, m) -> torch.Tensor:
        return _bytes_of(_filled(dtype_of(m.into[0]), m.into[1], k + 9000))

    def message(k: int, m) -> torch.Tensor:
        return _bytes_of(_filled(dtype_of(m.sent[0]), m.sent[1], k))

    def in_place(k: int, m) -> torch.Tensor:  # what MPI_Irecv straight into the tensor leaves
        got, sent = before(k, m), message(k, m)
        n = min(got.numel(), sent.numel())
        got[:n] = sent[:n]
        return got

    def padded(k: int, m) -> torch.Tensor:
        got = torch.zeros_like(before(k, m))
        n = min(got.numel(), message(k, m).numel())
        got[:n] = message(k, m)[:n]
        return got

    right = [(before, "CollectiveMismatchError", False), (in_place, "CollectiveMismatchError", False)]
    right += [(before, "CollectiveTimeout", True), (before, "CollectiveMismatchError", True)]
    for buffer, error, blind in right:
        _judge_mismatches(plan, _mismatch_records(plan, buffer, error, follow=not blind), blind=blind, device="cpu")
    wrong = [
        (padded, "CollectiveMismatchError", False, "neither its own nor the message's"),
        (padded, None, False, "it returned normally"),
        (before, "CollectiveTimeout", False, "it raised CollectiveTimeout"),  # sizes are checked: a refusal
        (padded, None, True, "checks_message_size=False"),
    ]
    for buffer, error, blind, said in wrong:
        with pytest.raises(ConformanceFailure) as caught:
            _judge_mismatches(plan, _mismatch_records(plan, buffer, error, follow=not blind), blind=blind, device="cpu")
        assert caught.value.check == "receive-mismatch", str(caught.value)
        assert said in caught.value.detail, caught.value.detail


def test_bucket_layout_puts_every_buffer_of_every_op_between_sentinels() -> None:
    """In the ``bucket`` layout every input and output of every op is a dense view at a non-zero offset of a
    larger flat storage, with sentinels after it too, and a rank's storages have the shapes of every other
    rank's (the checks compare them position by position)."""
    from pg_core.testing.buffers import prepare
    from pg_core.testing.cases import Call

    n = 3
    splits = [[(i + j) % 3 for j in range(n)] for i in range(n)]
    calls = [
        Call("all_reduce", "int64", (2, 3), "bucket", params={"reduce": "SUM"}),
        Call("broadcast", "uint8", (), "bucket", params={"root": 1}),
        Call("reduce", "float16", (1,), "bucket", params={"reduce": "MAX", "root": 2}),
        Call("all_gather", "bool", (0, 2), "bucket"),
        Call("all_gather_into_tensor", "float32", (4,), "bucket", params={"out_form": "concat"}),
        Call("reduce_scatter", "complex64", (5,), "bucket", params={"reduce": "SUM"}),
        Call("reduce_scatter_tensor", "int8", (2,), "bucket", params={"reduce": "MIN", "out_form": "stack"}),
        Call("all_to_all", "bfloat16", (2,), "bucket", params={"splits": splits}),
        Call("all_to_all_single", "int32", (3,), "bucket", params={"splits": splits}),
        Call("gather", "float64", (1, 1), "bucket", params={"root": 0}),
        Call("scatter", "int16", (3,), "bucket", params={"root": 2}),
        Call("p2p", "float32", (), "bucket", params={"messages": [[0, 1, 0, [3], "int64"], [2, 0, 7, [], "uint8"]]}),
    ]
    for call in calls:
        per_rank = [prepare(call, (5, 0, 0), r, n) for r in range(n)]
        for r, bufs in enumerate(per_rank):
            pairs = list(zip(bufs.ins, bufs.in_bases, strict=True)) + list(zip(bufs.outs, bufs.out_bases, strict=True))
            assert pairs, f"{call.op}: rank {r} has no buffers"
            for view, base in pairs:
                where = f"{call.op} rank {r}: a {tuple(view.shape)} view at offset {view.storage_offset()} of {base.numel()}"
                assert base.dim() == 1 and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), where
                assert view.is_contiguous() and view.storage_offset() >= 1, where
                assert base.numel() - view.storage_offset() - view.numel() >= 1, where
            shapes = [b.shape for b in bufs.in_bases + bufs.out_bases]
            if call.op not in ("broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "p2p"):
                first = per_rank[0]
                assert shapes == [b.shape for b in first.in_bases + first.out_bases], f"{call.op}: rank {r} differs"
