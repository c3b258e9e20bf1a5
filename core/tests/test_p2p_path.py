"""Point to point's lane (``ProcessGroup._p2p_lane``, :class:`pg_core.instance.Lane`): once a
call of a kind has passed the full checks for a (device, dtype), later calls skip the checks
that cannot change (isend/irecv too, where the backend has its own), and every rule still holds for the calls that must not take the lane: a
tensor that is not dense (any more), a dtype not declared, another device with the same dtype,
a closed group, a tag past the backend's range, a stream whose helper thread still has work.
The flight recorder's entries of calls on the lane say what the full path's say."""

from __future__ import annotations

import threading

import pytest
import torch
from pg_core import (
    Backend,
    BackendContext,
    Capabilities,
    GroupClosedError,
    HashStore,
    NotSupportedError,
    ProcessGroup,
    Work,
)
from pg_core.recorder import head_of


class Logged(Backend):
    """Logs every send/recv (op, device type, shape, peer, wire tag, whether its tensor was
    dense and plain); a recv writes 7s. ``fail`` makes the next calls raise it; while ``gate``
    is set, a send waits until the event is."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.log: list[tuple] = ctx.options["log"]
        self.fail: BaseException | None = None
        self.gate: threading.Event | None = None

    def _rec(self, op: str, tensor: torch.Tensor, peer: int, tag: int) -> None:
        plain = tensor.is_contiguous() and not tensor.is_neg() and not tensor.is_conj() and not tensor.requires_grad
        self.log.append((op, tensor.device.type, tuple(tensor.shape), peer, tag, plain))
        if self.fail is not None:
            raise self.fail

    def send(self, tensor, dst, tag, *, timeout):
        gate = self.gate
        if gate is not None:
            assert gate.wait(30), "the test never opened the gate"
        self._rec("send", tensor, dst, tag)

    def recv(self, tensor, src, tag, *, timeout):
        self._rec("recv", tensor, src, tag)
        if tensor.device.type == "cpu":
            tensor.fill_(7)


class CpuLogged(Logged):
    name = "cpu-logged"
    capabilities = Capabilities(
        ops=frozenset({"send", "recv"}), dtypes=frozenset({torch.float32, torch.complex64, torch.int64})
    )


class MetaLogged(Logged):
    name = "meta-logged"
    capabilities = Capabilities(ops=frozenset({"send", "recv"}), dtypes=frozenset({torch.float32}), max_tag=None)


def _group(log: list) -> ProcessGroup:
    return ProcessGroup(
        HashStore(),
        rank=0,
        size=2,
        backends={"cpu": CpuLogged, "meta": MetaLogged},
        options={"cpu-logged": {"log": log}, "meta-logged": {"log": log}},
    )


def _backend(group: ProcessGroup) -> Logged:
    backend = group._dispatch.instance(torch.device("cpu"), "send").backend  # (the test's own backend)
    assert isinstance(backend, Logged)
    return backend


@pytest.fixture
def log() -> list:
    return []


@pytest.fixture
def group(log: list):
    g = _group(log)
    yield g
    g.abort()


def _lanes(group: ProcessGroup) -> list[tuple[str, str, torch.dtype]]:
    return sorted((k, d.type, t) for k, d, t in group._p2p_lanes)


def test_a_tensor_that_is_not_dense_after_its_lane_was_made_is_staged(group, log):
    x = torch.arange(6.0)
    group.send(x, 1)
    group.recv(x, 1)
    assert _lanes(group) == [("recv", "cpu", torch.float32), ("send", "cpu", torch.float32)]
    log.clear()
    grid = torch.arange(6.0).reshape(2, 3)
    group.send(grid.t(), 1)  # transposed: same dtype and device as the lane's, not dense
    group.send(torch._neg_view(x), 1)  # lazily negated: dense strides, but not the values in memory
    out = torch.zeros(3, 2).t()
    group.recv(out, 1)
    assert out.tolist() == [[7.0, 7.0, 7.0]] * 2  # written back through the staging copy
    assert [(op, shape, plain) for op, _, shape, _, _, plain in log] == [
        ("send", (3, 2), True),
        ("send", (6,), True),
        ("recv", (2, 3), True),
    ]
    # a complex dtype's lane checks conjugation too: a lazily conjugated tensor is resolved first
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    group.send(z, 1)
    log.clear()
    group.send(z.conj(), 1)
    assert log[-1][5] is True


def test_a_dtype_not_declared_after_a_declared_one_took_the_lane_is_refused_before_anything_is_sent(group, log):
    group.send(torch.ones(2), 1)
    group.send(torch.ones(2), 1)
    log.clear()
    with pytest.raises(NotSupportedError, match="float64"):
        group.send(torch.ones(2, dtype=torch.float64), 1)
    with pytest.raises(NotSupportedError, match="float64"):
        group.recv(torch.ones(2, dtype=torch.float64), 1)
    assert log == []


def test_another_device_with_the_lanes_dtype_goes_to_its_own_backend_and_range(group, log):
    group.send(torch.ones(2), 1, tag=3)  # the cpu lane of float32
    group.send(torch.ones(2), 1, tag=3)
    meta = torch.ones(2, device="meta")
    with pytest.raises(NotSupportedError, match="carries no tags"):  # meta's backend has none: tag 0 only
        group.send(meta, 1, tag=3)
    group.send(meta, 1)
    group.send(meta, 1)  # its own lane now
    with pytest.raises(NotSupportedError, match="carries no tags"):
        group.send(meta, 1, tag=1)
    assert [(op, dev, tag) for op, dev, _, _, tag, _ in log] == [
        ("send", "cpu", 8),
        ("send", "cpu", 8),
        ("send", "meta", 0),
        ("send", "meta", 0),
    ]
    assert _lanes(group) == [("send", "cpu", torch.float32), ("send", "meta", torch.float32)]


def test_requires_grad_after_the_lane_is_staged_and_detached(group, log):
    group.send(torch.ones(3), 1)
    log.clear()
    param = torch.ones(3, requires_grad=True)
    group.send(param, 1)
    assert log[-1][5] is True  # the backend got a detached tensor
    assert param.requires_grad


def test_a_closed_group_refuses_calls_that_had_a_lane(log):
    for how in ("shutdown", "abort"):
        g = _group(log)
        g.send(torch.ones(1), 1)
        assert g.recv(torch.ones(1), 1) == 1
        log.clear()
        getattr(g, how)()
        with pytest.raises(GroupClosedError):
            g.send(torch.ones(1), 1)
        with pytest.raises(GroupClosedError):
            g.recv(torch.ones(1), 1)
        assert log == []


def test_a_blocking_call_on_the_lane_queues_behind_its_streams_helper_thread(group, log):
    group.send(torch.ones(1), 1, tag=9)  # the lane, made before any helper thread exists
    log.clear()
    gate = _backend(group).gate = threading.Event()
    try:
        work = group.isend(torch.full((1,), 1.0), 1, tag=9)  # on the stream's helper thread, held at the gate
        after = threading.Thread(target=lambda: group.send(torch.full((2,), 2.0), 1, tag=9), daemon=True)
        after.start()
        after.join(0.5)  # a blocking send that overtook the isend would be past the gate's log by now
        assert after.is_alive() and log == []
        gate.set()
        work.wait(10)
        after.join(10)
        assert not after.is_alive()
        assert [shape for _, _, shape, _, _, _ in log] == [(1,), (2,)]  # in the order they were called
    finally:
        gate.set()


def test_the_recorders_entries_of_calls_on_the_lane_are_the_full_paths(group, log):
    t = torch.ones(2, 3)
    group.send(t, 1)  # the full path
    group.send(t, 1)  # the lane
    backend = _backend(group)
    backend.fail = ConnectionResetError("the wire broke")
    with pytest.raises(ConnectionResetError):
        group.send(t, 1)  # the lane, failing
    with pytest.raises(ConnectionResetError):
        group.recv(t, 1)  # no recv lane yet: the full path, failing
    backend.fail = None
    group.recv(t, 1)
    group.recv(t, 1)  # the recv lane
    entries = group.debug_state()["entries"]
    shown = [
        (e["op"], e["p2p_seq"], e["peer"], e["input_sizes"], e["input_dtypes"], e["device"], e["state"], e["error"])
        for e in entries
    ]
    assert shown == [
        ("send", 1, 1, [[2, 3]], ["float32"], "cpu", "completed", None),
        ("send", 2, 1, [[2, 3]], ["float32"], "cpu", "completed", None),
        ("send", 3, 1, [[2, 3]], ["float32"], "cpu", "failed", "ConnectionResetError"),
        ("recv", 4, 1, [[2, 3]], ["float32"], "cpu", "failed", "ConnectionResetError"),
        ("recv", 5, 1, [[2, 3]], ["float32"], "cpu", "completed", None),
        ("recv", 6, 1, [[2, 3]], ["float32"], "cpu", "completed", None),
    ]
    assert all(e["seq"] is None and e["end_ns"] >= e["start_ns"] for e in entries)
    assert head_of(entries)["p2p"] is None  # the newest one completed
    assert group.debug_state()["recorder"]["capacity"] > 0


class NativeLogged(CpuLogged):
    """:class:`CpuLogged` with its own ``isend``/``irecv`` (logged as such, done at once)."""

    name = "native-logged"

    def isend(self, tensor, dst, tag, *, timeout):
        self._rec("isend", tensor, dst, tag)
        return Work.completed("isend")

    def irecv(self, tensor, src, tag, *, timeout):
        self._rec("irecv", tensor, src, tag)
        tensor.fill_(7)
        return Work.completed("irecv")


def test_isend_and_irecv_take_the_lane_to_the_backends_own_calls_and_every_rule_still_holds(log, monkeypatch):
    g = ProcessGroup(
        HashStore(), rank=0, size=2, backends={"cpu": NativeLogged}, options={"native-logged": {"log": log}}
    )
    try:
        x = torch.arange(4.0)
        g.isend(x, 1, tag=3).wait()  # the full path, which makes the lanes
        g.irecv(torch.zeros(4), 1, tag=3).wait()
        assert _lanes(g) == [("recv", "cpu", torch.float32), ("send", "cpu", torch.float32)]
        full = list(log)
        log.clear()
        checked = []
        full_path = g._p2p
        monkeypatch.setattr(g, "_p2p", lambda *a, **k: checked.append(a[0]) or full_path(*a, **k))
        g.isend(x, 1, tag=3).wait()  # the lanes: no full checks
        got = torch.zeros(4)
        g.irecv(got, 1, tag=3).wait()
        assert checked == [] and log == full and got.tolist() == [7.0] * 4  # the same calls, wire tags and all
        log.clear()
        grid = torch.arange(6.0).reshape(2, 3)
        g.isend(grid.t(), 1).wait()  # not dense: the full path stages it
        out = torch.zeros(3, 2).t()
        g.irecv(out, 1).wait()
        assert out.tolist() == [[7.0, 7.0, 7.0]] * 2  # written back through the staging copy
        with pytest.raises(ValueError):
            g.isend(x, 0)  # to itself
        with pytest.raises(ValueError):
            g.irecv(x, 2)  # no such rank
        with pytest.raises(TypeError):
            g.isend(x, 1, tag=True)
        assert checked == ["send", "recv", "send", "recv", "send"]
        assert [(op, shape, plain) for op, _, shape, _, _, plain in log] == [
            ("isend", (3, 2), True),
            ("irecv", (2, 3), True),
        ]
        log.clear()
        g.abort()
        with pytest.raises(GroupClosedError):
            g.isend(x, 1, tag=3)
        with pytest.raises(GroupClosedError):
            g.irecv(x, 1, tag=3)
        assert log == []
    finally:
        g.abort()
