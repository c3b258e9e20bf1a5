"""The dispatcher and ProcessGroup's local behaviour, with in-process recording backends
on two device types (cpu and meta): routing by device, lazy creation, validation and
capability checks before the backend sees anything, staging, ordering, life cycle."""

from __future__ import annotations

import itertools
import queue
import threading
import warnings

import pytest
import torch
from pg_core import (
    Backend,
    BackendContext,
    BackendNotFoundError,
    BackendSpec,
    BackendUnavailableError,
    Capabilities,
    CollectiveTimeout,
    GroupClosedError,
    HashStore,
    NotSupportedError,
    PluginError,
    ProcessGroup,
    ReduceOp,
)
from pg_core.dispatch import parse_backends
from pg_core.group import P2POp
from pg_core.registry import Registry
from pg_core.work import Work


class Recorder(Backend):
    """Records every call (op, device type, shapes); all_reduce adds 1 so results are visible."""

    created: list[str] = []

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.log: list[tuple] = ctx.options["log"]
        self.created.append(ctx.device.type)

    def _rec(self, name, *tensors, **extra):
        self.log.append((name, self.ctx.device.type, [tuple(t.shape) for t in tensors if t is not None], extra))
        for t in tensors:
            if t is not None:
                assert t.is_contiguous(), f"{name} got a non-contiguous tensor"

    def send(self, tensor, dst, tag, *, timeout):
        self._rec("send", tensor, dst=dst, tag=tag)

    def recv(self, tensor, src, tag, *, timeout):
        self._rec("recv", tensor, src=src, tag=tag)
        if tensor.device.type == "cpu":
            tensor.fill_(7)

    def all_reduce(self, tensor, op, *, timeout):
        self._rec("all_reduce", tensor, op=op, timeout=timeout)
        if tensor.device.type == "cpu":
            tensor.add_(1)

    def broadcast(self, tensor, src, *, timeout):
        self._rec("broadcast", tensor, src=src)

    def all_gather(self, output_list, tensor, *, timeout):
        self._rec("all_gather", tensor, *output_list)
        for o in output_list:
            o.copy_(tensor)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, *, timeout):
        self._rec("all_to_all_single", output, input, out=output_split_sizes, inp=input_split_sizes)

    def gather(self, tensor, gather_list, dst, *, timeout):
        self._rec("gather", tensor, *(gather_list or []), has_list=gather_list is not None)

    def barrier(self, *, timeout):
        self._rec("barrier")


class CpuRecorder(Recorder):
    name = "cpu-rec"
    capabilities = Capabilities(dtypes=frozenset({torch.float32, torch.int64, torch.complex64}))


class MetaRecorder(Recorder):
    name = "meta-rec"
    capabilities = Capabilities(ops=frozenset({"all_reduce", "send", "recv"}), dtypes=frozenset({torch.float32}))


@pytest.fixture
def log():
    return []


@pytest.fixture
def group(log):
    Recorder.created = []
    g = ProcessGroup(
        HashStore(),
        rank=0,
        size=2,
        backends={"cpu": CpuRecorder, "meta": MetaRecorder},
        options={"cpu-rec": {"log": log}, "meta-rec": {"log": log}},
    )
    yield g
    g.abort()


def test_each_device_type_goes_to_its_backend_created_on_first_use(group, log):
    assert group.backends == {"cpu": "cpu-rec", "meta": "meta-rec"}
    assert Recorder.created == []
    group.all_reduce(torch.zeros(3, device="meta"))
    assert Recorder.created == ["meta"]
    t = torch.zeros(3)
    group.all_reduce(t)
    assert Recorder.created == ["meta", "cpu"]
    assert [(op, dev) for op, dev, *_ in log] == [("all_reduce", "meta"), ("all_reduce", "cpu")]
    assert t.tolist() == [1, 1, 1]
    group.all_reduce(torch.zeros(2, device="meta"))
    assert Recorder.created == ["meta", "cpu"]  # created once


def test_capabilities_are_enforced_before_the_backend_is_called(group, log):
    with pytest.raises(NotSupportedError, match="meta.*op 'broadcast' is not supported"):
        group.broadcast(torch.zeros(2, device="meta"), src=0)
    with pytest.raises(NotSupportedError, match="dtype torch.float64 is not supported"):
        group.all_reduce(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(NotSupportedError, match="MAX is not supported for torch.complex64"):
        group.all_reduce(torch.zeros(2, dtype=torch.complex64), ReduceOp.MAX)
    with pytest.raises(NotSupportedError, match="AVG is not supported for torch.int64"):
        group.all_reduce(torch.zeros(2, dtype=torch.int64), ReduceOp.AVG)
    with pytest.raises(NotSupportedError, match="no backend for device type 'cuda'"):
        group.supports("all_reduce", "cuda") or group._supported.check(
            "all_reduce", torch.device("cuda"), torch.float32
        )
    assert log == []
    assert group.supports("all_reduce", "cpu", torch.float32, ReduceOp.SUM)
    assert not group.supports("all_reduce", "cpu", torch.complex64, ReduceOp.MAX)
    assert group.supports("isend", "meta", torch.float32)
    assert not group.supports("broadcast", "meta")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda g: g.broadcast(torch.zeros(2), src=2), ValueError, "src=2 is out of range"),
        (lambda g: g.broadcast(torch.zeros(2), src="0"), TypeError, "src must be an int"),
        (lambda g: g.send(torch.zeros(2), dst=-1), ValueError, "dst=-1 is out of range"),
        (lambda g: g.send(torch.zeros(2), dst=0), ValueError, "cannot send to itself"),
        (lambda g: g.send(torch.zeros(2), dst=1, tag=-3), ValueError, "tag must be >= 0"),
        (lambda g: g.all_reduce([1, 2]), TypeError, "must be a torch.Tensor"),
        (lambda g: g.all_gather([torch.zeros(2)], torch.zeros(2)), ValueError, "one tensor per rank"),
        (lambda g: g.all_gather([torch.zeros(2), torch.zeros(3)], torch.zeros(2)), ValueError, "has 3 elements"),
        (
            lambda g: g.all_gather([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], torch.zeros(2)),
            ValueError,
            "one dtype",
        ),
        (
            lambda g: g.all_gather([torch.zeros(2), torch.zeros(2, device="meta")], torch.zeros(2)),
            ValueError,
            "one device",
        ),
        (lambda g: g.all_to_all_single(torch.zeros(3), torch.zeros(3)), ValueError, "not divisible"),
        (lambda g: g.all_to_all_single(torch.zeros(3), torch.zeros(3), [1, 1], [1, 2]), ValueError, "sum to 2"),
        (lambda g: g.all_to_all_single(torch.zeros(4, 2), torch.zeros(4, 3)), ValueError, "must agree beyond dim 0"),
        (lambda g: g.gather(torch.zeros(2), None, dst=0), ValueError, "must pass gather_list"),
        (lambda g: g.gather(torch.zeros(2), [torch.zeros(2)] * 2, dst=1), ValueError, "only passed on the destination"),
        (lambda g: g.all_reduce(torch.zeros(2), "median"), ValueError, "unknown reduce op"),
        (lambda g: g.all_reduce(torch.zeros(2), timeout=-1), ValueError, "timeout must be positive"),
    ],
)
def test_bad_input_raises_locally_before_anything_is_sent(group, log, call, error, match):
    with pytest.raises(error, match=match):
        call(group)
    assert log == []


def test_non_contiguous_tensors_are_staged_and_results_copied_back(group, log):
    base = torch.zeros(4, 3)
    view = base.t()  # non-contiguous
    group.all_reduce(view)
    assert torch.equal(base, torch.ones(4, 3))
    out = torch.zeros(3, 4)
    outs = [out.t(), torch.zeros(4, 3)]
    group.all_gather(outs, torch.arange(12.0).reshape(4, 3))
    assert torch.equal(out.t(), torch.arange(12.0).reshape(4, 3))
    r = torch.zeros(2, 2).t()
    group.recv(r, src=1)
    assert torch.equal(r, torch.full((2, 2), 7.0))


def test_split_sizes_are_filled_in_and_gather_list_only_reaches_the_root(group, log):
    group.all_to_all_single(torch.zeros(4, 2), torch.zeros(4, 2))
    assert log[-1][3] == {"out": [2, 2], "inp": [2, 2]}
    group.all_to_all_single(torch.zeros(5), torch.zeros(3), [2, 3], [2, 1])
    assert log[-1][3] == {"out": [2, 3], "inp": [2, 1]}
    group.gather(torch.zeros(2), dst=1)
    assert log[-1][3] == {"has_list": False}


def test_async_collectives_run_in_order_and_blocking_ones_wait_their_turn(group, log):
    works = [group.all_reduce(torch.zeros(1), async_op=True) for _ in range(5)]
    group.barrier()
    assert all(w.is_completed() for w in works)
    assert [entry[0] for entry in log] == ["all_reduce"] * 5 + ["barrier"]
    assert "completed" in repr(works[0])


def test_per_call_timeout_reaches_the_backend(group, log):
    group.all_reduce(torch.zeros(1), timeout=2.5)
    assert log[-1][3]["timeout"] == 2.5
    group.all_reduce(torch.zeros(1))
    assert log[-1][3]["timeout"] == group.timeout


class Stuck(Backend):
    """all_reduce blocks until abort(); all_gather times out."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.released = threading.Event()
        self.entered = ctx.options["entered"]

    def send(self, tensor, dst, tag, *, timeout):
        raise AssertionError("not used")

    recv = send

    def all_reduce(self, tensor, op, *, timeout):
        self.entered.set()
        if not self.released.wait(timeout):
            raise AssertionError("abort() did not wake the blocked operation")
        raise GroupClosedError("aborted while waiting")

    def all_gather(self, output_list, tensor, *, timeout):
        raise CollectiveTimeout("no answer from rank 1", peers=[1])

    def abort(self):
        self.released.set()
        super().abort()


def test_abort_from_another_thread_wakes_a_blocked_operation_and_closes_the_group():
    entered = threading.Event()
    g = ProcessGroup(HashStore(), rank=0, size=2, backends=Stuck, options={"Stuck": {"entered": entered}})
    errors = []

    def blocked():
        try:
            g.all_reduce(torch.zeros(1))
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    assert entered.wait(10)
    g.abort()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(errors[0], GroupClosedError)
    with pytest.raises(GroupClosedError, match="aborted"):
        g.barrier()
    assert "aborted" in repr(g)


def test_timeouts_name_the_op_and_sequence_number():
    g = ProcessGroup(HashStore(), rank=0, size=2, backends=Stuck, options={"Stuck": {"entered": threading.Event()}})
    with pytest.raises(CollectiveTimeout) as info:
        g.all_gather([torch.zeros(1)] * 2, torch.zeros(1))
    assert (info.value.op, info.value.seq, info.value.peers) == ("all_gather", 1, (1,))
    # messages of the failed collective may still arrive: later collectives refuse instead of reading them
    with pytest.raises(CollectiveTimeout, match="stopped after all_gather \\(collective #1\\) failed"):
        g.barrier()
    g.abort()


def test_use_after_shutdown_raises_group_closed(group):
    group.all_reduce(torch.zeros(1))
    group.shutdown()
    group.shutdown()  # idempotent
    with pytest.raises(GroupClosedError, match="shut down"):
        group.all_reduce(torch.zeros(1))
    with pytest.raises(GroupClosedError):
        group.send(torch.zeros(1), dst=1)


def test_batch_isend_irecv_validates_everything_first(group, log):
    ops = [P2POp(group.isend, torch.zeros(2), 1), P2POp(group.irecv, torch.zeros(2), 1, tag=3)]
    works = group.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    # the default isend/irecv run on independent helper threads: no order between the two;
    # the backend sees user tag t as wire tag 2 + 2t (pg_core.tags)
    assert sorted((e[0], sorted(e[3].items())) for e in log) == [
        ("recv", [("src", 1), ("tag", 2 + 2 * 3)]),
        ("send", [("dst", 1), ("tag", 2)]),
    ]
    log.clear()
    with pytest.raises(ValueError, match="out of range"):
        group.batch_isend_irecv([P2POp("isend", torch.zeros(2), 1), P2POp("irecv", torch.zeros(2), 5)])
    assert log == []


def test_groups_with_one_name_form_new_generations_and_ranks_are_unique():
    store = HashStore()
    a = ProcessGroup(store, rank=0, size=2, backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    b = ProcessGroup(store, rank=1, size=2, backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    assert a.uid == b.uid and a.uid.startswith("world#0-")
    c = ProcessGroup(store, rank=0, size=1, backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    assert c.uid.startswith("world#1-")  # re-formed with another size: a new generation
    # another job (another store) forming the same name and generation gets another uid
    elsewhere = ProcessGroup(HashStore(), rank=0, size=1, backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    assert elsewhere.uid.startswith("world#0-") and elsewhere.uid != a.uid
    elsewhere.shutdown()
    d = ProcessGroup(store, rank=0, size=2, name="other", backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    with pytest.raises(ValueError, match="already has a rank 0"):
        ProcessGroup(store, rank=0, size=2, name="other", backends=CpuRecorder, options={"cpu-rec": {"log": []}})
    for g in (a, b, c, d):
        g.shutdown()


def test_backends_string_forms_parse():
    assert parse_backends("cpu:gloo, cuda : nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backends(" gloo ") == "gloo"
    assert parse_backends(None) is None
    with pytest.raises(ValueError, match="expected 'device:backend'"):
        parse_backends("cpu:gloo,cuda:")
    with pytest.raises(ValueError, match="appears twice"):
        parse_backends("cpu:gloo,cpu:tcp")


def test_repr_shows_name_rank_size_and_backends(group):
    assert repr(group) == "<ProcessGroup 'world' rank 0/2 backends={cpu: cpu-rec, meta: meta-rec}>"


def test_a_generation_that_never_filled_is_skipped_once_its_members_closed():
    store = HashStore()
    opts = {"cpu-rec": {"log": []}}
    partial = [ProcessGroup(store, rank=r, size=3, backends=CpuRecorder, options=opts) for r in (0, 1)]
    for g in partial:  # rank 2 never came; the others give up
        g.abort()
    again = [ProcessGroup(store, rank=r, size=3, backends=CpuRecorder, options=opts) for r in (2, 0, 1)]
    assert len({g.uid for g in again}) == 1 and again[0].uid.startswith("world#1-")
    for g in again:
        g.shutdown()


def test_a_failing_done_callback_does_not_stop_the_progress_thread(group, log, caplog):
    w = group.all_reduce(torch.zeros(1), async_op=True)
    w.add_done_callback(lambda _: 1 / 0)
    w.wait()
    later = group.all_reduce(torch.zeros(1), async_op=True)
    later.add_done_callback(lambda _: 1 / 0)
    assert later.wait(timeout=10)
    assert group.all_reduce(torch.zeros(1), async_op=True).wait(timeout=10)


def test_a_blocking_call_from_a_done_callback_is_refused_not_a_deadlock(group):
    seen = []

    def callback(_):
        try:
            group.barrier()
        except RuntimeError as exc:
            seen.append(str(exc))

    w = group.all_reduce(torch.zeros(1), async_op=True)
    w.add_done_callback(callback)
    w.wait()
    assert group.barrier(async_op=True).wait(timeout=10)
    assert seen and "async_op=True" in seen[0]


def test_a_group_dropped_without_shutdown_is_collected_and_its_thread_ends(log):
    import gc
    import weakref

    g = ProcessGroup(HashStore(), rank=0, size=2, backends=CpuRecorder, options={"cpu-rec": {"log": log}})
    g.all_reduce(torch.zeros(1), async_op=True).wait()
    worker = g._executor._worker
    ref = weakref.ref(g)
    del g
    gc.collect()
    assert ref() is None
    worker.join(10)
    assert not worker.is_alive()


def test_work_wait_takes_a_timedelta_like_torch(group):
    from datetime import timedelta

    assert group.all_reduce(torch.zeros(1), async_op=True).wait(timedelta(seconds=5))


# -- receiving from any source (API 1.4) ----------------------------------------------------------


class AnySource(Backend):
    """Declares ``recv_anysource``; every receive is logged, and an any-source one "comes from" the
    rank its options name (or returns what ``reply`` says, to prove the core checks it)."""

    name = "any-rec"
    capabilities = Capabilities(
        ops=frozenset({"send", "recv", "recv_anysource"}), dtypes=frozenset({torch.float32, torch.int64})
    )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.log: list[tuple] = ctx.options["log"]
        self.reply = ctx.options.get("reply", 2)

    def send(self, tensor, dst, tag, *, timeout):
        self.log.append(("send", dst, tag))

    def recv(self, tensor, src, tag, *, timeout):
        self.log.append(("recv", src, tag))
        tensor.fill_(src)

    def recv_anysource(self, tensor, tag, *, timeout):
        self.log.append(("recv_anysource", tag, threading.current_thread().name))
        tensor.fill_(-1)
        return self.reply


def any_group(log, size=3, rank=0, **extra):
    return ProcessGroup(
        HashStore(), rank=rank, size=size, backends=AnySource, options={"any-rec": {"log": log, **extra}}
    )


def test_recv_returns_the_sender_named_or_from_any_source_with_the_tag_mapped_as_for_recv(log):
    with any_group(log) as group:
        t = torch.zeros(2, 3).t()  # staged, and the result copied back
        assert group.recv(t, 1, tag=4) == 1
        assert group.recv(t, tag=4) == 2  # src=None
        assert t.eq(-1).all()
        assert group.recv(t, None, 4) == 2
        assert group.irecv(t, 1, 4).wait(10)
        assert group.irecv(t, tag=4).result(10) == 2  # from any source: the Work's result is the sender
        assert group.supports("recv_anysource", "cpu", torch.float32)
    wire = 2 + 2 * 4  # pg_core.tags: user tag t is wire tag 2 + 2t, for any source as for a named peer
    assert [e[:3] if e[0] == "recv" else e[:2] for e in log] == [
        ("recv", 1, wire),
        ("recv_anysource", wire),
        ("recv_anysource", wire),
        ("recv", 1, wire),
        ("recv_anysource", wire),
    ]


class GatedAnySource(AnySource):
    """An any-source receive on user tag 0 (wire tag 2) blocks until the test opens the gate."""

    name = "gated-any-rec"

    def recv_anysource(self, tensor, tag, *, timeout):
        source = super().recv_anysource(tensor, tag, timeout=timeout)
        if tag == 2:
            self.ctx.options["entered"].set()
            assert self.ctx.options["gate"].wait(timeout)
        return source


def test_any_source_receives_of_a_tag_are_one_stream_in_call_order_on_the_core_helper(log):
    entered, gate = threading.Event(), threading.Event()
    options = {"gated-any-rec": {"log": log, "entered": entered, "gate": gate}}
    with ProcessGroup(HashStore(), rank=0, size=3, backends=GatedAnySource, options=options) as group:
        first = group.irecv(torch.zeros(1), None, 0)  # no native irecv_anysource: the tag's helper runs it
        assert entered.wait(10)
        other_tag = group.irecv(torch.zeros(1), None, 1)  # another tag is another stream: not held up
        assert other_tag.result(10) == 2
        blocking = group.irecv(torch.zeros(1), None, 0)
        gate.set()
        assert group.recv(torch.zeros(1), None, 0) == 2  # blocking, behind the tag's pending ones
        assert [first.result(10), blocking.result(10)] == [2, 2]
    streams = [(tag, name.rpartition("-recv-any-")[2]) for _, tag, name in log]
    assert [tag for tag, _ in streams] == [2, 4, 2, 2]  # wire tags, in call order per tag
    # the irecvs run on their tag's helper thread; the blocking recv there too, or inline on
    # this thread if the helper had finished the ones before it (both keep the tag's order)
    assert all(str(tag) == stream for tag, stream in streams[:3]), streams
    assert streams[3][1] in ("2", "MainThread"), streams


def test_batch_isend_irecv_takes_peer_none_for_a_receive_from_any_source(log):
    with any_group(log) as group:
        works = group.batch_isend_irecv(
            [P2POp(group.irecv, torch.zeros(1), None), P2POp(group.isend, torch.zeros(1), 1)]
        )
        assert [w.result(10) for w in works] == [2, None]
        log.clear()
        with pytest.raises(TypeError, match="dst must be an int"):  # a send needs a peer
            group.batch_isend_irecv(
                [P2POp(group.irecv, torch.zeros(1), None), P2POp(group.isend, torch.zeros(1), None)]
            )
        assert log == []


@pytest.mark.parametrize("reply", [None, 0, 3, -1, True, "1"])
def test_a_backend_that_returns_no_valid_sender_is_named(log, reply):
    with any_group(log, reply=reply) as group:
        with pytest.raises(PluginError, match=f"backend 'any-rec' broke the contract.*returned {reply!r}"):
            group.recv(torch.zeros(1))
        with pytest.raises(PluginError, match="not the group rank of the sender"):
            group.irecv(torch.zeros(1)).wait(10)


def test_an_undeclared_receive_from_any_source_is_refused_before_the_backend_sees_it(group, log):
    t = torch.zeros(2)
    with pytest.raises(
        NotSupportedError, match=r"src=None.*backend 'cpu-rec' on cpu does not declare 'recv_anysource'.*src=RANK"
    ):
        group.recv(t)
    with pytest.raises(NotSupportedError, match="recv_anysource"):
        group.irecv(t, None, 3)
    with pytest.raises(NotSupportedError, match="recv_anysource"):
        group.batch_isend_irecv([P2POp(group.isend, t, 1), P2POp(group.irecv, t, None)])
    assert log == []
    assert not group.supports("recv_anysource", "cpu", torch.float32)
    assert group.recv(t, 1) == 1  # naming the sender works


def test_the_default_capabilities_leave_optional_ops_out_and_name_them_when_unknown():
    assert "recv_anysource" not in Capabilities().ops
    assert "recv_anysource" in Capabilities(ops=frozenset({"recv_anysource"})).ops
    with pytest.raises(ValueError, match="recv_anysource"):  # the known ops are listed, the optional one too
        Capabilities(ops=frozenset({"recv_any"}))


def test_a_receive_from_any_source_needs_another_rank(log):
    with any_group(log, size=1) as group:
        with pytest.raises(ValueError, match="no rank but this one"):
            group.recv(torch.zeros(1))
        with pytest.raises(ValueError, match="src=0 is this rank"):
            group.recv(torch.zeros(1), 0)
    assert log == []


# -- a prepared all_reduce (API 1.5) ---------------------------------------------------------------
class Prepared(CpuRecorder):
    """Offers a prepared all_reduce (it adds 10, the plain one adds 1); a non-empty option
    ``fail`` makes the prepared call time out once."""

    def prepared_all_reduce(self, dtype, op, *, timeout):
        self.log.append(("prepare", str(dtype), op.type.name, timeout))

        def run(tensor):
            self._rec("prepared", tensor, op=op.type.name)
            if self.ctx.options["fail"]:
                self.ctx.options["fail"].clear()
                raise CollectiveTimeout("rank 1 did not answer", peers=[1])
            tensor.add_(10)

        return run


@pytest.fixture
def prepared(log):
    options = {"log": log, "fail": []}
    g = ProcessGroup(HashStore(), rank=0, size=2, backends=Prepared, options={"cpu-rec": options}, timeout=30)
    yield g, options
    g.abort()


def test_a_prepared_all_reduce_takes_the_blocking_calls_of_a_kind_once_one_went_the_full_way(prepared, log):
    g, _ = prepared
    t = torch.zeros(3)
    g.all_reduce(t)
    g.all_reduce(t)
    assert [e[0] for e in log] == ["all_reduce", "prepare", "prepared"]
    assert log[1] == ("prepare", "torch.float32", "SUM", 30.0)  # asked once per kind, with the group's timeout
    assert t.tolist() == [11.0] * 3
    g.all_reduce(t, op=ReduceOp.MAX)  # another reduce op, another dtype: each its own kind
    g.all_reduce(t, op=ReduceOp.MAX)
    g.all_reduce(torch.zeros(2, dtype=torch.int64))
    g.all_reduce(torch.zeros(2, dtype=torch.int64))
    assert [e[0] for e in log[3:]] == ["all_reduce", "prepare", "prepared", "all_reduce", "prepare", "prepared"]
    assert g._executor.seq == 6  # numbered in the group's order like any collective
    del log[:]
    # what the prepared call does not take: asynchronous, its own timeout, a layout to stage,
    # autograd, a tensor subclass, a block being coalesced
    g.all_reduce(t, async_op=True).wait()
    g.all_reduce(t, timeout=5)
    strided = torch.zeros(4)[::2]
    g.all_reduce(strided)
    g.all_reduce(torch.zeros(3, requires_grad=True))
    g.all_reduce(torch.nn.Parameter(torch.zeros(3)))
    with g.coalescing():
        g.all_reduce(t)
    for factor in (2.0, 3.0):  # PREMUL_SUM: a factor per call, never prepared
        g.all_reduce(t, op=ReduceOp.premul_sum(factor))
    assert [e[0] for e in log] == ["all_reduce"] * 8
    assert strided.tolist() == [1.0, 1.0]
    with pytest.raises(NotSupportedError):  # the capability check is not skipped
        g.all_reduce(torch.zeros(1, dtype=torch.float16))


def test_a_prepared_all_reduce_waits_behind_queued_collectives_and_its_failure_stops_the_group(prepared, log):
    g, options = prepared
    t = torch.zeros(1)
    g.all_reduce(t)
    works = [g.all_reduce(torch.zeros(1), async_op=True) for _ in range(3)]
    g.all_reduce(t)
    assert all(w.is_completed() for w in works)
    assert [e[0] for e in log] == ["all_reduce", "prepare"] + ["all_reduce"] * 3 + ["prepared"]
    options["fail"].append(True)
    with pytest.raises(CollectiveTimeout) as info:
        g.all_reduce(t)
    assert (info.value.op, info.value.seq) == ("all_reduce", 6)
    with pytest.raises(CollectiveTimeout, match="stopped after all_reduce \\(collective #6\\) failed"):
        g.all_reduce(t)


# -- a native split (API 1.6) ----------------------------------------------------------------------
class InMemory(Backend):
    """Thread ranks of one process: every message is a copy put in the queue of its (group
    formation, sender, receiver, tag). Records its creation (with ``ctx.split_from``) in the
    ``log`` of its options (one per rank)."""

    name = "memory"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.queues: dict = ctx.options["queues"]
        self.lock: threading.Lock = ctx.options["lock"]
        self.log: list = ctx.options["log"]
        self.log.append(("created", ctx.group_name, ctx.rank, ctx.split_from))

    def _queue(self, src, dst, tag) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((self.ctx.group_uid, src, dst, tag), queue.Queue())

    def _get(self, src, tag, timeout):
        try:
            return self._queue(src, self.rank, tag).get(timeout=timeout)
        except queue.Empty:
            raise CollectiveTimeout(f"nothing from rank {src} in {timeout} s", peers=[src]) from None

    def send(self, tensor, dst, tag, *, timeout):
        self._queue(self.rank, dst, tag).put(tensor.clone())

    def recv(self, tensor, src, tag, *, timeout):
        tensor.copy_(self._get(src, tag, timeout))

    def send_bytes(self, data, dst, tag, *, timeout):
        self._queue(self.rank, dst, tag).put(b"".join(bytes(memoryview(p).cast("B")) for p in data))

    def recv_bytes(self, src, tag, *, timeout):
        return bytearray(self._get(src, tag, timeout))


class NativeSplit(InMemory):
    """Splits "natively": records the call and returns a handle naming what it was asked for."""

    name = "memory-split"

    def split(self, color, rank, *, timeout):
        self.log.append(("split", self.ctx.group_name, self.rank, color, rank, timeout))
        return None if color is None else ("handle", self.ctx.group_uid, color, rank)


class Releasing(NativeSplit):
    """Also makes a handle for ``color=None``, and records what the core gives back."""

    name = "memory-split"

    def split(self, color, rank, *, timeout):
        made = super().split(color, rank, timeout=timeout)
        made = ("no subgroup", self.ctx.group_uid, rank) if made is None else made
        self.log.append(("made", self.ctx.group_name, self.rank, made))
        return made

    def release_split(self, handle):
        self.log.append(("released", self.ctx.group_name, self.rank, handle))


def _thread_ranks(size: int, fn, backend: type[Backend] = NativeSplit) -> list:
    """``fn(rank, group, log)`` on ``size`` thread ranks of a group on ``backend``, each with a log of
    its own; every rank's (result, log), or the first rank's error."""
    store, queues, lock = HashStore(), {}, threading.Lock()
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        log: list = []
        try:
            options = {name: {"queues": queues, "lock": lock, "log": log} for name in ("memory", "memory-split")}
            with ProcessGroup(store, rank, size, backends=backend, options=options, timeout=30) as group:
                results[rank] = (fn(rank, group, log), log)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a rank is stuck"
    if errors:
        raise errors[0]
    return results


def test_split_calls_the_parents_native_split_on_every_member_and_hands_the_handle_to_the_subgroup():
    colors, keys = [5, None, 2, 5], [3, 9, 0, 1]  # colors 2 and 5 are subgroups 0 and 1; 5 ranks 3 before 0

    def body(rank, group, log):
        before = group._executor.seq
        sub = group.split(colors[rank], key=keys[rank], timeout=20)
        numbered = group._executor.seq - before  # the all_gather_object, then the split
        if sub is None:
            return numbered, None
        made = sub._dispatch.instance(torch.device("cpu")).backend.ctx.split_from  # made inside split()
        t = torch.tensor([float(rank)])
        sub.all_reduce(t)
        members = sub.all_gather_object(rank)
        sub.shutdown()
        return numbered, (sub.rank, sub.parent_ranks, made, t.item(), members)

    results = _thread_ranks(4, body)
    (n0, r0), (n1, r1), (n2, r2), (n3, r3) = (result for result, _ in results)
    assert n0 == n1 == n2 == n3 == 2  # the split is one collective of the parent, after its all_gather_object
    assert r1 is None
    assert r0[:2] == (1, (3, 0)) and r3[:2] == (0, (3, 0)) and r2[:2] == (0, (2,))
    assert [r[3:] for r in (r0, r3, r2)] == [(3.0, [3, 0]), (3.0, [3, 0]), (2.0, [2])]
    logs = [log for _, log in results]
    parent = results[0][1][0][1]  # the name the first backend was created with: the parent's
    splits = [[e for e in log if e[0] == "split"] for log in logs]
    # once on every member, color None included, with dense colors and the subgroup ranks
    assert [[e[1:] for e in calls] for calls in splits] == [
        [(parent, 0, 1, 1, 20.0)],
        [(parent, 1, None, 1, 20.0)],
        [(parent, 2, 0, 0, 20.0)],
        [(parent, 3, 1, 0, 20.0)],
    ]
    for rank, log in enumerate(logs):
        created = [e for e in log if e[0] == "created"]
        if rank == 1:
            assert [e[3] for e in created] == [None]  # the parent's backend only
            continue
        # the subgroup's backend was created right after the split, inside split(), with the handle
        at = log.index(splits[rank][0])
        sub = log[at + 1]
        assert sub[0] == "created" and sub[1] != parent
        handle = sub[3]
        assert handle[0] == "handle" and handle[2:] == (splits[rank][0][3], splits[rank][0][4])
        assert handle == results[rank][0][1][2]
        assert [e[3] for e in created] == [None, handle]


class Plain(InMemory):
    """The same in-memory backend without a native split."""

    name = "memory"


def test_a_split_whose_subgroups_change_backend_and_new_group_never_split_natively():
    def body(rank, group, log):
        seqs = []
        seqs.append(group._executor.seq)
        # every subgroup on another backend
        everyone = group.split(0, backends=Plain)
        seqs.append(group._executor.seq)
        # decided together: only color 0's members move to another backend, and nobody splits natively
        mixed = group.split(rank % 2, backends=Plain if rank % 2 == 0 else None)
        seqs.append(group._executor.seq)
        pair = group.new_group([0, 2]) if rank in (0, 2) else None
        seqs.append(group._executor.seq)
        out = []
        for sub in (everyone, mixed, pair):
            if sub is None:
                continue
            assert not any(e[0] == "created" and e[1] == sub.name for e in log), "created before its first use"
            t = torch.ones(1)
            sub.all_reduce(t)
            out.append((sub.name, sub.backends["cpu"], t.item()))
            sub.shutdown()
        return [b - a for a, b in itertools.pairwise(seqs)], out

    results = _thread_ranks(4, body)
    for rank, ((numbered, used), log) in enumerate(results):
        assert numbered == [1, 1, 0]  # each split took its all_gather_object's number only
        assert not [e for e in log if e[0] == "split"]
        assert all(e[3] is None for e in log if e[0] == "created")  # no handle anywhere
        backends = [b for _, b, _ in used]
        assert backends == (["memory", "memory", "memory-split"] if rank in (0, 2) else ["memory", "memory-split"])
        assert [v for *_, v in used] == ([4.0, 2.0, 2.0] if rank in (0, 2) else [4.0, 2.0])


def test_a_handle_made_for_no_subgroup_goes_back_to_the_backend_that_made_it():
    colors = [0, None, 0, None]

    def body(rank, group, log):
        sub = group.split(colors[rank])
        if sub is not None:
            sub.shutdown()
        return sub is None

    results = _thread_ranks(4, body, Releasing)
    for rank, (outside, log) in enumerate(results):
        made = [e[3] for e in log if e[0] == "made"]
        released = [e[3] for e in log if e[0] == "released"]
        taken = [e[3] for e in log if e[0] == "created" and e[3] is not None]
        assert outside == (colors[rank] is None) and len(made) == 1
        if outside:  # its handle came back to the parent's backend, once
            assert made[0][0] == "no subgroup" and released == made and taken == []
        else:  # its subgroup's backend took it; nothing came back
            assert made[0][0] == "handle" and released == [] and taken == made


def test_a_subgroup_that_fails_to_form_after_the_split_gives_its_handle_back(monkeypatch):
    import pg_core.membership as membership

    real_form = membership.form

    def form(store, prefix, key, *args, **kwargs):
        if key.startswith("split"):  # the subgroup's store exchange, after the native split
            raise ConnectionError(f"the store went away forming {key}")
        return real_form(store, prefix, key, *args, **kwargs)

    monkeypatch.setattr(membership, "form", form)

    def body(rank, group, log):
        with pytest.raises(ConnectionError, match="the store went away forming split0.7"):
            group.split(7)

    results = _thread_ranks(3, body, Releasing)
    for rank, (_, log) in enumerate(results):
        made = [e[3] for e in log if e[0] == "made"]
        assert [e[3:5] for e in log if e[0] == "split"] == [(0, rank)]
        assert [e[3] for e in log if e[0] == "released"] == made  # given back, once
        assert [e for e in log if e[0] == "created" and e[3] is not None] == []  # no backend took it


# -- blocking point to point's fast path -----------------------------------------------------------
def test_blocking_send_and_recv_skip_the_checks_that_passed_once_and_still_refuse_bad_input(group, log):
    t = torch.arange(3.0)
    for tag in (1, 5):  # the full path, once per kind and tag
        group.send(t, 1, tag=tag)
        assert group.recv(t, 1, tag=tag) == 1
    first = [(op, extra["tag"]) for op, _, _, extra in log]
    assert sorted(k for k, _, _ in group._p2p_lanes) == ["recv", "send"]  # one per kind, whatever the tag
    log.clear()
    for tag in (1, 5):  # the lane: the same calls, with the same wire tags
        group.send(t, 1, tag=tag)
        assert group.recv(t, 1, tag=tag) == 1
    assert [(op, extra["tag"]) for op, _, _, extra in log] == first
    assert t.tolist() == [7.0, 7.0, 7.0]
    log.clear()
    refused = [
        (lambda: group.send(t, 0, tag=5), ValueError, "dst=0 is this rank"),
        (lambda: group.recv(t, 2, tag=5), ValueError, "src=2 is out of range"),
        (lambda: group.send(t, -1, tag=5), ValueError, "dst=-1 is out of range"),
        (lambda: group.send(t, True, tag=5), TypeError, "dst must be an int group rank"),
        (lambda: group.send(t, 1, tag=True), TypeError, "tag must be an int"),  # True == 1, a lane's tag
        (lambda: group.recv(t, 1, tag=[5]), TypeError, "tag must be an int"),
        (lambda: group.send(t, 1, tag=-5), ValueError, "tag must be >= 0"),
        (lambda: group.send(t, 1, tag=2**62), NotSupportedError, "carries user tags below"),
        (lambda: group.send([1.0], 1, tag=5), TypeError, "must be a torch.Tensor"),
    ]
    for call, error, match in refused:
        with pytest.raises(error, match=match):
            call()
    assert log == []  # nothing reached the backend
    # tensors the backend may not be handed as they are take the full path, and are staged
    strided = torch.zeros(2, 3).t()
    group.recv(strided, 1, tag=5)
    assert strided.tolist() == [[7.0, 7.0]] * 3
    param = torch.zeros(3, requires_grad=True)
    group.recv(param, 1, tag=5)
    assert param.tolist() == [7.0] * 3 and param.requires_grad
    assert [(op, shape) for op, _, (shape,), _ in log] == [("recv", (3, 2)), ("recv", (3,))]
    group.shutdown()
    with pytest.raises(GroupClosedError):
        group.send(t, 1, tag=5)


# -- the executor's lane (a blocking all_reduce's hot path) ----------------------------------------


def test_an_executor_lane_numbers_in_order_queues_behind_async_and_refuses_as_call_does():
    from pg_core.errors import CollectiveTimeout, GroupClosedError, PGError
    from pg_core.executor import Executor

    ex = Executor("lane-test")
    seen: list[tuple[str, int]] = []
    lane = ex.lane("all_reduce", lambda arg: seen.append((arg, ex.seq)) or arg)
    assert lane("a") == "a" and lane("b") == "b"
    assert seen == [("a", 1), ("b", 2)]  # in the caller's thread, numbered like any collective

    # an asynchronous collective queued and still running: the lane's call queues behind it (the
    # async one waits until the executor's queue has that second item), not beside it
    queued = threading.Event()

    class Signalling(queue.SimpleQueue):  # the executor's queue, telling the test what was queued
        def put(self, item, block=True, timeout=None):
            super().put(item, block, timeout)
            if item is not None and item[1] == "all_reduce":
                queued.set()

    ex._queue = Signalling()  # before the progress thread starts (it takes the queue when it does)

    def slow(seq: int) -> str:
        assert queued.wait(10), "the lane's call was not queued behind the running collective"
        seen.append(("async", seq))
        return "async"

    work = ex.run("broadcast", slow, async_op=True)
    done: list[str] = []
    caller = threading.Thread(target=lambda: done.append(lane("c")))
    caller.start()
    caller.join(10)
    assert work.result() == "async" and done == ["c"]
    assert seen[2:] == [("async", 3), ("c", 4)]  # run on the progress thread, in order
    where = ex.lane("all_reduce", lambda arg: threading.current_thread())
    assert where(None) is threading.current_thread()  # idle again: inline, though a progress thread exists

    # on the progress thread, a blocking lane call is refused as call() refuses it
    errors: list[str] = []

    def from_callback(seq: int) -> None:
        try:
            lane("d")
        except RuntimeError as exc:
            errors.append(str(exc))

    ex.run("barrier", from_callback, async_op=True).result()
    assert errors and "async_op=True" in errors[0]

    # a failure the executor latches stops later collectives, the lane's included
    def times_out(arg: object) -> None:
        raise CollectiveTimeout("planted")

    failing = Executor("lane-failure")
    with pytest.raises(CollectiveTimeout):
        failing.lane("all_reduce", times_out)("x")
    ran: list[object] = []
    with pytest.raises(PGError, match="stopped after all_reduce .collective #1. failed"):
        failing.lane("all_reduce", ran.append)("y")
    assert ran == []

    # closed: refused before anything runs
    assert ex.drain(10)
    with pytest.raises(GroupClosedError, match="shut down"):
        lane("e")
    assert [s for s, _ in seen] == ["a", "b", "async", "c"] and ex.seq == 6  # and `where`, the barrier


# -- a backend that is installed but cannot run here --------------------------------------------

NO_META = "no meta accelerator on this machine: install one"


def unavailable_meta(log) -> ProcessGroup:
    spec = BackendSpec("meta-rec", MetaRecorder, ("meta",), MetaRecorder.capabilities, is_available=lambda: NO_META)
    return ProcessGroup(
        HashStore(), 0, 2, backends={"cpu": CpuRecorder, "meta": spec}, options={"cpu-rec": {"log": log}}
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda g: g.all_reduce(torch.ones(2, device="meta")),
        lambda g: g.all_reduce(torch.ones(2, device="meta"), async_op=True),
        lambda g: g.send(torch.ones(2, device="meta"), dst=1),
        lambda g: g.irecv(torch.ones(2, device="meta"), src=1),
        lambda g: g.broadcast(torch.ones(2, device="meta"), src=0),  # not declared either: unavailable comes first
    ],
    ids=["all_reduce", "async", "send", "irecv", "undeclared"],
)
def test_an_unavailable_backend_forms_the_group_and_raises_on_its_device_types_first_use(log, call):
    Recorder.created = []
    group = unavailable_meta(log)
    try:
        assert group.backends == {"cpu": "cpu-rec", "meta": "meta-rec"}
        assert not group.supports("all_reduce", "meta") and group.supports("all_reduce", "cpu")
        assert "meta: meta-rec (unavailable here)" in repr(group)
        for _ in range(2):  # every use, not only the first
            with pytest.raises(BackendUnavailableError) as err:
                call(group)
            message = str(err.value)
            assert NO_META in message and "group 'world' cannot run meta tensors here" in message
            assert "its other backends work: cpu: cpu-rec" in message
        assert Recorder.created == [] and log == []  # refused before anything was created or sent
        group.all_reduce(t := torch.zeros(3))  # the cpu backend works as ever
        assert t.tolist() == [1.0, 1.0, 1.0] and Recorder.created == ["cpu"]
    finally:
        group.abort()


def test_the_backend_of_the_groups_messages_must_run_here_at_construction(log):
    def spec(device: str) -> BackendSpec:
        return BackendSpec(
            "cpu-rec", CpuRecorder, (device,), CpuRecorder.capabilities, is_available=lambda: "no, not here"
        )

    for backends in ({"cpu": spec("cpu"), "meta": MetaRecorder}, spec("cpu"), {"meta": spec("meta")}):
        with pytest.raises(BackendUnavailableError, match="'cpu-rec' is installed but unavailable: no, not here"):
            ProcessGroup(HashStore(), 0, 1, backends=backends)


def test_names_are_checked_at_construction_and_availability_at_first_use():
    reg = Registry(load_entry_points=False)
    reg.register(BackendSpec("cpu-rec", CpuRecorder, ("cpu",), CpuRecorder.capabilities))
    reg.register(BackendSpec("far", MetaRecorder, ("meta",), MetaRecorder.capabilities, is_available=lambda: NO_META))
    for backends in ({"cpu": "cpu-rec", "meta": "far"}, " cpu:cpu-rec , meta : far "):
        group = ProcessGroup(HashStore(), 0, 1, backends=backends, registry=reg, options={"cpu-rec": {"log": []}})
        with pytest.raises(BackendUnavailableError, match=NO_META):
            group.all_reduce(torch.ones(1, device="meta"))
        group.shutdown()
    with pytest.raises(BackendNotFoundError, match=r"Unknown backend 'fra'.*Installed: cpu-rec .*, far "):
        ProcessGroup(HashStore(), 0, 1, backends={"cpu": "cpu-rec", "meta": "fra"}, registry=reg)
    with pytest.raises(NotSupportedError, match="'far' does not support device 'cpu'"):
        ProcessGroup(HashStore(), 0, 1, backends="cpu:far", registry=reg)
    with pytest.raises(BackendUnavailableError, match=NO_META):  # the only backend: the group's messages need it
        ProcessGroup(HashStore(), 0, 1, backends="far", registry=reg)


def test_groups_of_backend_classes_leave_nothing_behind_in_the_process_wide_registry(log):
    import gc

    from pg_core.registry import default_registry

    def sizes() -> int:
        gc.collect()
        return len(default_registry()._availability)

    ProcessGroup(HashStore(), 0, 1, backends={"cpu": CpuRecorder}, options={"cpu-rec": {"log": log}}).shutdown()
    before = sizes()
    for _ in range(5):  # each group makes a spec of its own for the class
        ProcessGroup(HashStore(), 0, 1, backends={"cpu": CpuRecorder}, options={"cpu-rec": {"log": log}}).shutdown()
    assert sizes() == before


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.ones(4).to_sparse(), id="sparse_coo"),
        pytest.param(lambda: torch.ones(4, 4).to_sparse_csr(), id="sparse_csr"),
        pytest.param(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), id="nested"),
    ],
)
def test_a_tensor_that_is_not_dense_strided_is_refused_by_kind_before_the_backend_sees_it(group, log, make):
    """Sparse and nested tensors have no strides to hand a backend: a NotSupportedError naming
    the kind and what to do, on the first call and on the prepared path alike, not torch's raw
    'unsupported memory format' or 'NestedTensorImpl doesn't support strides'. (A sparse COO
    tensor's all_reduce SUM is summed from gathers of its parts, as Gloo does: any other
    reduction of it is refused, as Gloo refuses it.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warning for nested tensors
        t = make()
    group.all_reduce(torch.ones(4))  # a dense call first: the blocking all_reduce's prepared path exists
    del log[:]
    for call in (
        lambda: group.all_reduce(t, ReduceOp.MAX),
        lambda: group.broadcast(t, 0),
        lambda: group.send(t, 1),
    ):
        with pytest.raises(NotSupportedError, match="sparse|nested") as info:
            call()
        assert "dense" in str(info.value)
    assert log == []


class WaitingSends(Backend):
    """Declares that its sends above 1 KiB may wait for their receivers, has no isend of its
    own, and leaves every collective to the core's defaults."""

    name = "waiting-sends"
    capabilities = Capabilities(dtypes=frozenset({torch.float32}), eager_limit_bytes=1024)

    def send(self, tensor, dst, tag, *, timeout):
        raise AssertionError("nothing may be sent by a backend the core refused")

    def recv(self, tensor, src, tag, *, timeout):
        raise AssertionError("nothing may be received by a backend the core refused")


class WaitingSendsWithIsend(WaitingSends):
    """The same with a truly asynchronous isend (here: one that records it was posted)."""

    name = "waiting-sends-isend"

    def isend(self, tensor, dst, tag, *, timeout):
        return Work.completed("isend")


class WaitingSendsOwnCollectives(WaitingSends):
    """The same declaring only collectives it implements itself."""

    name = "waiting-sends-own"
    capabilities = Capabilities(
        ops=frozenset({"all_reduce", "send", "recv"}), dtypes=frozenset({torch.float32}), eager_limit_bytes=1024
    )

    def all_reduce(self, tensor, op, *, timeout):
        tensor.add_(1)


def test_a_backend_whose_sends_may_wait_needs_an_isend_for_the_default_collectives():
    """The default collectives post a send, then receive: with a send that waits in the posting
    thread, the ranks of a ring would each wait for the next. Refused when the backend is
    created, naming the backend, its limit and the collectives, before anything is sent."""
    g = ProcessGroup(HashStore(), rank=0, size=2, backends=WaitingSends)
    try:
        with pytest.raises(
            PluginError, match=r"'waiting-sends' declares eager_limit_bytes=1024 for cpu .*isend.*all_reduce"
        ):
            g.all_reduce(torch.ones(2))
    finally:
        g.abort()
    for fine in (WaitingSendsWithIsend, WaitingSendsOwnCollectives):
        g = ProcessGroup(HashStore(), rank=0, size=2, backends=fine)
        try:
            if fine is WaitingSendsOwnCollectives:
                t = torch.ones(2)
                g.all_reduce(t)
                assert t.tolist() == [2.0, 2.0]
            else:  # created without complaint: its isend is its own
                assert g._dispatch.instance(torch.device("cpu")).native_isend
        finally:
            g.abort()


def test_form_backend_creates_the_device_types_backend_once_and_returns_it(group):
    assert Recorder.created == []
    meta = group.form_backend("meta")
    assert isinstance(meta, MetaRecorder) and Recorder.created == ["meta"]
    assert group.form_backend(torch.device("meta")) is meta  # made already: the same one, nothing formed
    assert isinstance(group.form_backend("cpu"), CpuRecorder)
    assert Recorder.created == ["meta", "cpu"]
    with pytest.raises(ValueError, match=r"no backend for device type 'cuda'.*cpu, meta"):
        group.form_backend("cuda")


def test_open_batch_is_this_threads_block_only(group):
    assert group.open_batch is None
    seen: list[object] = []
    with group.coalescing() as batch:
        assert group.open_batch is batch
        other = threading.Thread(target=lambda: seen.append(group.open_batch))
        other.start()
        other.join(10)
        with pytest.raises(RuntimeError, match="blocks do not nest"):
            group.coalescing()
        with pytest.raises(RuntimeError, match="monitored_barrier cannot run inside a coalescing block"):
            group.monitored_barrier()
    assert seen == [None]  # another thread's view: no block of its own
    assert group.open_batch is None


def test_open_blocks_is_false_unless_a_block_is_open():
    from pg_core.coalescing import OpenBlocks

    blocks = OpenBlocks("g")
    assert not blocks and blocks.current() is None and not blocks.inside()
    blocks.refuse_inside("barrier")  # outside any block: nothing to refuse
    sentinel = object()
    ident = blocks.enter(sentinel)  # type: ignore[arg-type]
    assert blocks and blocks.current() is sentinel and blocks.inside()
    with pytest.raises(RuntimeError, match="barrier cannot run inside a coalescing block of group 'g'"):
        blocks.refuse_inside("barrier")
    with pytest.raises(RuntimeError, match="blocks do not nest"):
        blocks.enter(sentinel)  # type: ignore[arg-type]
    blocks.leave(ident)
    assert not blocks and blocks.current() is None
