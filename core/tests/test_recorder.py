"""The flight recorder in one process: the ring, what the executor notes in it, the desync
report's text and its exchange through a store, dumps in torch's format (read by torch's own
analyser), and the reader that loads no class."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import HashStore
from pg_core.errors import CollectiveMismatchError, CollectiveTimeout, PeerFailureError
from pg_core.executor import Executor
from pg_core.ops import ReduceOp
from pg_core.recorder import (
    COMPLETED,
    DEFAULT_BUFFER,
    FAILED,
    SCHEDULED,
    STARTED,
    FlightRecorder,
    Tracer,
    buffer_size,
    describe_args,
    head_of,
    shape_of,
    trace_dir,
    where,
)
from pg_core.traces import dump_name, load_dump, merge, write_dump
from pg_core.work import Work


def test_the_environment_sizes_the_ring_and_names_the_folder() -> None:
    assert buffer_size({}) == DEFAULT_BUFFER == 2000
    assert buffer_size({"PG_CORE_TRACE_BUFFER": "0"}) == 0
    assert buffer_size({"PG_CORE_TRACE_BUFFER": " 16 "}) == 16
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match=r"PG_CORE_TRACE_BUFFER='.*' is not a number.*non-negative integer"):
            buffer_size({"PG_CORE_TRACE_BUFFER": bad})
    assert trace_dir({}) is None
    assert trace_dir({"PG_CORE_TRACE_DIR": ""}) is None
    assert trace_dir({"PG_CORE_TRACE_DIR": "/tmp/x"}) == Path("/tmp/x")
    with pytest.raises(ValueError, match="capacity=0"):
        FlightRecorder(0)


def test_the_ring_keeps_the_last_n_operations_oldest_first() -> None:
    rec = FlightRecorder(3)
    records = [rec.tensor_collective(seq, "all_reduce", torch.ones(seq), "cpu") for seq in range(1, 6)]
    for record in records[:-1]:
        rec.finished(record)
    rec.finished(records[0], CollectiveTimeout("late"))  # its slot was reused: ignored
    entries = rec.entries()
    assert [e["seq"] for e in entries] == [3, 4, 5]
    assert [e["state"] for e in entries] == [COMPLETED, COMPLETED, STARTED]
    assert [e["input_sizes"] for e in entries] == [[[3]], [[4]], [[5]]]
    assert entries[0]["input_dtypes"] == entries[0]["output_dtypes"] == ["float32"]
    assert entries[0]["duration_us"] is not None and entries[2]["end_ns"] is None
    assert abs(entries[2]["start_ns"] - time.time_ns()) < 60e9  # wall-clock nanoseconds
    json.dumps(entries)  # JSON-serialisable as they are
    rec.finished(records[4], CollectiveTimeout("stuck"))
    assert rec.entries()[-1]["state"] == FAILED and rec.entries()[-1]["error"] == "CollectiveTimeout"


def _p2p(
    rec: FlightRecorder,
    op: str,
    shape: torch.Size | None,
    dtype: torch.dtype,
    peer: int,
    *,
    error: BaseException | None = None,
    seen: list[dict[str, Any]] | None = None,
) -> None:
    """A blocking ``op`` of a tensor of ``shape`` and ``dtype`` with ``peer``, recorded around its
    call (:meth:`FlightRecorder.point_to_point`): the call puts the entries it sees in ``seen``
    and fails with ``error``, which the recorder re-raises."""

    def call(tensor: torch.Tensor, peer: int, tag: int, *, timeout: float) -> None:
        if seen is not None:
            seen.extend(rec.entries())
        if error is not None:
            raise error

    try:
        rec.point_to_point(op, shape, dtype, torch.device("cpu"), peer, call, torch.empty(0), 0, 1.0)
    except BaseException as exc:
        if exc is not error:
            raise


def test_operations_of_one_tensor_show_their_own_shape_and_dtype_however_they_alternate() -> None:
    rec = FlightRecorder(16)  # (consecutive calls of one shape and dtype share what they keep)
    a, b = torch.ones(2), torch.ones(2, dtype=torch.float64)
    _p2p(rec, "send", a.shape, a.dtype, 1)
    _p2p(rec, "send", a.shape, a.dtype, 1)
    _p2p(rec, "recv", b.shape, b.dtype, 1)  # the same shape, another dtype
    rec.tensor_collective(1, "all_reduce", torch.ones(3, 1), "cpu")
    _p2p(rec, "recv", None, a.dtype, 1)  # no one shape (nested): none shown
    _p2p(rec, "send", torch.Size([2]), a.dtype, 1)  # an equal shape, another object
    rec.tensor_collective(2, "all_reduce", torch.ones(3, 1, dtype=torch.int32), "cpu")
    entries = rec.entries()
    assert [e["input_sizes"] for e in entries] == [[[2]], [[2]], [[2]], [[3, 1]], [], [[2]], [[3, 1]]]
    assert [e["input_dtypes"] for e in entries] == [
        ["float32"],
        ["float32"],
        ["float64"],
        ["float32"],
        [],
        ["float32"],
        ["int32"],
    ]
    assert [e["output_sizes"] for e in entries] == [e["input_sizes"] for e in entries]
    assert [(e["seq"], e["root"]) for e in entries if e["seq"] is not None] == [(1, None), (2, None)]


def test_a_point_to_point_entry_in_a_reused_slot_shows_nothing_of_the_slots_last_occupant() -> None:
    rec = FlightRecorder(1)
    gather = rec.collective(
        7, "all_gather_into_tensor", describe_args("all_gather_into_tensor", (torch.empty(6), torch.ones(2))), "cpu"
    )
    rec.finished(gather, CollectiveTimeout("stuck"))
    seen: list[dict[str, Any]] = []
    _p2p(rec, "send", torch.Size([3]), torch.int64, 1, seen=seen)  # reuses the failed collective's slot
    (started,) = seen  # as its call saw it
    assert (started["seq"], started["p2p_seq"], started["op"], started["peer"]) == (None, 1, "send", 1)
    assert started["input_sizes"] == started["output_sizes"] == [[3]]
    assert started["input_dtypes"] == started["output_dtypes"] == ["int64"]
    assert (started["state"], started["error"], started["end_ns"], started["duration_us"]) == (
        STARTED,
        None,
        None,
        None,
    )
    assert "root" not in started and head_of([started])["p2p"] == {"op": "send", "peer": 1}
    (done,) = rec.entries()
    assert (done["state"], done["error"]) == (COMPLETED, None) and done["end_ns"] >= done["start_ns"]
    _p2p(rec, "recv", torch.Size([2, 2]), torch.float16, 0, error=PeerFailureError("gone"))
    (failed,) = rec.entries()
    assert (failed["op"], failed["p2p_seq"], failed["state"], failed["error"]) == (
        "recv",
        2,
        FAILED,
        "PeerFailureError",
    )
    assert failed["input_sizes"] == [[2, 2]] and failed["input_dtypes"] == ["float16"] and failed["device"] == "cpu"
    nested = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])
    assert shape_of(nested) is None and shape_of(torch.ones(2, 1)) == (2, 1)
    seen.clear()
    _p2p(rec, "send", shape_of(nested), nested.dtype, 1, error=TypeError("nested"), seen=seen)
    assert seen[0]["input_sizes"] == [] and seen[0]["p2p_seq"] == 3
    collective = rec.tensor_collective(8, "all_reduce", torch.ones(4), "cpu")  # and back: the collective's own fields
    (again,) = rec.entries()
    assert (again["seq"], again["p2p_seq"], again["root"], again["error"], again["end_ns"]) == (
        8,
        None,
        None,
        None,
        None,
    )
    rec.finished(collective)


def test_what_a_collective_is_made_of() -> None:
    out, inp = torch.empty(6), torch.ones(2, dtype=torch.int64)
    inputs, outputs, root = describe_args("all_gather_into_tensor", (out, inp))
    assert [tuple(s) for s, _ in inputs] == [(2,)] and inputs[0][1] == torch.int64
    assert outputs is not None and [tuple(s) for s, _ in outputs] == [(6,)]
    assert root == -1
    assert describe_args("broadcast", (inp, 2))[1:] == (None, 2)
    inputs, outputs, root = describe_args("gather", (inp, None, 1))  # not the root: no list
    assert len(inputs) == 1 and outputs == () and root == 1
    inputs, outputs, _ = describe_args("gather", (inp, [torch.empty(2)] * 3, 0))
    assert outputs is not None and len(outputs) == 3
    assert describe_args("barrier", ()) == ((), None, -1)


def test_the_executor_notes_every_collective_and_tells_the_group_of_a_failure() -> None:
    rec = FlightRecorder(16)
    told: list[tuple[str, int, str]] = []
    ex = Executor("g", lambda op, seq, exc: told.append((op, seq, type(exc).__name__)), rec)
    t = torch.ones(4)
    ex.run("all_reduce", lambda seq: None, async_op=False, args=(t, ReduceOp.SUM), device="cpu")
    lane = ex.lane("all_reduce", lambda tensor: None, "cpu")
    lane(torch.ones(2, dtype=torch.float64))
    launched = Work("broadcast")
    ex.run("broadcast", lambda seq: launched, async_op=False, args=(t, 1), device="cpu")
    assert rec.entries()[-1]["state"] == SCHEDULED  # the backend finishes it later
    launched.set_result(None)

    def timing_out(seq: int) -> None:
        raise CollectiveTimeout("no answer")

    with pytest.raises(CollectiveTimeout):
        ex.run("all_gather_into_tensor", timing_out, async_op=False, args=(torch.empty(8), t), device="cpu")
    entries = rec.entries()
    assert [(e["seq"], e["op"], e["state"]) for e in entries] == [
        (1, "all_reduce", COMPLETED),
        (2, "all_reduce", COMPLETED),
        (3, "broadcast", COMPLETED),
        (4, "all_gather_into_tensor", FAILED),
    ]
    assert entries[1]["input_dtypes"] == ["float64"] and entries[1]["device"] == "cpu"
    assert entries[2]["root"] == 1
    assert entries[3]["output_sizes"] == [[8]] and entries[3]["error"] == "CollectiveTimeout"
    assert told == [("all_gather_into_tensor", 4, "CollectiveTimeout")]
    assert head_of(entries) == {"current": [4, "all_gather_into_tensor"], "completed": [3, "broadcast"], "p2p": None}


def test_off_the_executor_records_nothing_and_still_explains() -> None:
    told: list[int] = []
    ex = Executor("g", lambda op, seq, exc: told.append(seq))

    def failing(seq: int) -> None:
        raise PeerFailureError("gone", peers=[1])

    ex.run("all_reduce", lambda seq: None, async_op=False)
    with pytest.raises(PeerFailureError):
        ex.run("all_reduce", failing, async_op=False)
    assert told == [2]


def test_who_is_where_reads_as_the_ranks_stand() -> None:
    heads: dict[int, dict[str, Any] | None] = {
        0: {"current": [57, "all_reduce"], "completed": [56, "all_reduce"], "p2p": None},
        1: {"current": None, "completed": [56, "all_reduce"], "p2p": {"op": "recv", "peer": 0}},
        2: {"current": [57, "all_reduce"], "completed": [56, "all_reduce"], "p2p": None},
        3: {"current": [57, "broadcast"], "completed": [56, "all_reduce"], "p2p": None},
        4: {"current": [58, "barrier"], "completed": [57, "all_reduce"], "p2p": None},
        5: None,
        6: None,
        7: {"current": None, "completed": None, "p2p": None},
    }
    assert where(57, heads, left=[6]) == (
        "ranks 0, 2 are in all_reduce #57; "
        "rank 1 never started #57 (last completed all_reduce #56; in recv from rank 0); "
        "rank 3 is in broadcast #57; "
        "rank 4 is past it, in barrier #58; "
        "rank 5 is not heard from (dead or stuck outside pg-core); "
        "rank 6 is not heard from: it left the group (shutdown or abort); "
        "rank 7 never started #57 (completed no collective)"
    )


def _tracer(store: HashStore, rank: int, size: int, rec: FlightRecorder | None, **kw: Any) -> Tracer:
    def describe() -> dict[str, Any]:
        return {"group": "world", "uid": "world#0-0123456789abcdef", "rank": rank, "size": size, "timeout": 0.4}

    options: dict[str, Any] = {"timeout": 0.4, "joined": None, "folder": None, **kw}
    return Tracer(
        store=store, rank=rank, size=size, name="world", uid="world#0-0123456789abcdef", recorder=rec,
        describe=describe, **options,
    )  # fmt: skip


def _ran(rec: FlightRecorder, *ops: str) -> None:
    for seq, op in enumerate(ops, start=1):
        rec.finished(rec.tensor_collective(seq, op, torch.ones(1), "cpu"))


def test_a_failed_collective_says_who_is_where_from_the_heads_in_the_store() -> None:
    store = HashStore()
    rec0, rec1, rec2 = FlightRecorder(8), FlightRecorder(8), FlightRecorder(8)
    for rec in (rec0, rec1, rec2):
        _ran(rec, "all_reduce", "all_reduce")
    # rank 1 skipped collective #3 and is blocked in a recv that gives up: it publishes its head
    _p2p(rec1, "recv", torch.Size([2]), torch.float32, 0, error=CollectiveTimeout("recv timed out"))
    _tracer(store, 1, 4, rec1).point_to_point_failed(CollectiveTimeout("recv timed out"))
    # rank 2 is in broadcast #3
    rec2.tensor_collective(3, "broadcast", torch.ones(1), "cpu")
    store.set(
        "trace/2",
        json.dumps(
            {"current": [3, "broadcast"], "completed": [2, "all_reduce"], "p2p": None, "wall_ns": time.time_ns()}
        ),
    )
    store.set("left/3", "1")  # rank 3 shut down without a word
    tracer = _tracer(store, 0, 4, rec0)
    exc = CollectiveTimeout("Timed out after 0.4 s in all_reduce (collective #3)", op="all_reduce", seq=3)
    began = time.monotonic()
    tracer.explain("all_reduce", 3, exc)
    waited = time.monotonic() - began
    assert waited < 1.5  # min(2 s, half the timeout), with room for a slow machine
    assert str(exc) == (
        "Timed out after 0.4 s in all_reduce (collective #3). Who is where in group 'world' at collective #3: "
        "rank 0 is in all_reduce #3; rank 1 never started #3 (last completed all_reduce #2; in recv from rank 0); "
        "rank 2 is in broadcast #3; rank 3 is not heard from: it left the group (shutdown or abort)"
    )
    assert tracer.report is not None and tracer.report["left"] == [3] and tracer.report["seq"] == 3
    assert json.loads(store.get("trace/0"))["current"] == [3, "all_reduce"]
    # only the group's first failure asks around: later ones leave their message alone
    later = CollectiveMismatchError("another")
    tracer.explain("all_reduce", 4, later)
    assert str(later) == "another"


def test_a_head_published_before_the_collective_could_begin_is_not_taken_for_where_a_rank_is() -> None:
    """Rank 1's head is from a failure long ago (it went on since): not heard from, not "in recv"."""
    store = HashStore()
    rec0 = FlightRecorder(8)
    _ran(rec0, "all_reduce", "all_reduce")
    an_hour_ago = time.time_ns() - 3600 * 10**9
    store.set(
        "trace/1", json.dumps({"current": None, "completed": [1, "all_reduce"], "p2p": None, "wall_ns": an_hour_ago})
    )
    tracer = _tracer(store, 0, 2, rec0)
    exc = CollectiveTimeout("Timed out after 0.4 s in all_reduce (collective #3)", op="all_reduce", seq=3)
    tracer.explain("all_reduce", 3, exc)
    assert "rank 1 is not heard from" in str(exc), str(exc)


def test_members_that_never_joined_are_the_whole_story_and_a_store_that_fails_changes_nothing() -> None:
    store = HashStore()
    joined_calls: list[CollectiveTimeout] = []

    def never_joined(exc: CollectiveTimeout) -> bool:
        joined_calls.append(exc)
        exc.args = ("rank 1 of 2 never joined group 'world'",)
        return True

    exc = CollectiveTimeout("timed out")
    _tracer(store, 0, 2, FlightRecorder(4), joined=never_joined).explain("barrier", 1, exc)
    # a rewritten message that does not say "Timed out" gets it in front (torch's words)
    assert str(exc) == "Timed out: rank 1 of 2 never joined group 'world'" and joined_calls == [exc]

    class Broken(HashStore):
        def set(self, key: str, value: Any) -> None:
            raise RuntimeError("store gone")

    exc = CollectiveTimeout("Timed out after 1 s in barrier (collective #1)")
    _tracer(Broken(), 0, 2, None).explain("barrier", 1, exc)
    assert str(exc) == "Timed out after 1 s in barrier (collective #1)"


def _state(rank: int, size: int, ops: list[str], *, failed: str | None = None) -> dict[str, Any]:
    rec = FlightRecorder(16)
    _ran(rec, *ops)
    if failed is not None:
        rec.finished(rec.tensor_collective(len(ops) + 1, failed, torch.ones(3), "cpu"), CollectiveTimeout("t"))
    tracer = _tracer(HashStore(), rank, size, rec)
    state = tracer.state()
    state["backends"] = {"cpu": "tcp"}
    return state


def test_dumps_are_in_torchs_format_and_torchs_analyser_reads_them(tmp_path: Path) -> None:
    states = [
        _state(0, 3, ["all_reduce", "all_reduce"], failed="all_reduce"),
        _state(1, 3, ["all_reduce", "all_reduce"]),
        _state(2, 3, ["all_reduce", "all_reduce"], failed="all_reduce"),
    ]
    paths = [write_dump(tmp_path, s) for s in states]
    assert [p.name for p in paths] == [dump_name("world", "world#0-0123456789abcdef", r) for r in range(3)]
    assert paths[0].name == "world-01234567-rank0"
    dump = load_dump(paths[0])
    assert dump["version"] == "2.10" and dump["pg_core"]["rank"] == 0
    first = dump["entries"][0]
    assert first["profiling_name"] == "gloo:all_reduce" and first["input_dtypes"] == ["Float"]
    assert first["collective_seq_id"] == 1 and first["state"] == "completed" and first["is_p2p"] is False
    assert dump["pg_config"]["world#0-0123456789abcdef"]["ranks"] == "[0, 1, 2]"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(tmp_path),
            "-p",
            "world-01234567-rank",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = run.stdout + run.stderr
    assert run.returncode == 0, said
    assert "Not all ranks joining collective, sequence number: 3" in said, said
    assert "missing ranks: {1}" in said, said


def test_merged_dumps_name_the_first_divergence_and_the_ranks_not_heard_from() -> None:
    states = [
        _state(0, 4, ["all_reduce", "all_reduce"], failed="all_reduce"),
        _state(1, 4, ["all_reduce", "all_reduce"]),
        _state(2, 4, ["all_reduce", "all_reduce"], failed="broadcast"),
    ]
    (group,) = merge(states)
    assert group["dumped"] == [0, 1, 2] and group["not_heard"] == [3]
    assert group["divergence"]["seq"] == 3
    assert group["divergence"]["ranks"]["1"] is None
    assert group["divergence"]["ranks"]["0"] == "all_reduce #3 float32[3] (failed: CollectiveTimeout)"
    assert group["divergence"]["ranks"]["2"] == "broadcast #3 float32[3] (failed: CollectiveTimeout)"
    assert group["where"] == (
        "rank 0 is in all_reduce #3; rank 1 never started #3 (last completed all_reduce #2); "
        "rank 2 is in broadcast #3; rank 3 is not heard from (dead or stuck outside pg-core)"
    )
    json.dumps(group)


def test_a_dump_is_read_without_loading_any_class(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "world-00000000-rank0"
    path.write_bytes(pickle.dumps({"entries": [Planted()], "pg_config": {}}))
    with pytest.raises(ValueError, match=r"not a flight-recorder dump: refused posix\.system"):
        load_dump(path)
    assert not marker.exists()
    (tmp_path / "text").write_text("hello")
    with pytest.raises(ValueError, match="text is not a flight-recorder dump"):
        load_dump(tmp_path / "text")
