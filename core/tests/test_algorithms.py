"""The default collectives of ``pg_core.algorithms``, with threads as ranks.

Every rank is a thread talking through ``ThreadChannel``: per (src, dst) FIFO
queues of cloned tensors. The channel is strict where a real transport would be
unforgiving: a receive whose size or dtype differs from the message fails; a
buffer handed to ``isend`` must not change before ``wait``; a buffer handed to
``irecv`` is filled only at ``wait`` (and poisoned before), so reading it early
shows; every ``isend``/``irecv`` must be waited; and no message may be left
unreceived when the operation ends. Every wait is bounded, so a bug fails fast
instead of hanging.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_core import algorithms
from pg_core.algorithms import Tuning
from pg_core.backend import DTYPES, Backend, BackendContext, default_reduce_ops
from pg_core.errors import CollectiveTimeout
from pg_core.ops import RedOpType, ReduceOp
from pg_core.work import Work

SIZES = (1, 2, 3, 4, 5, 8)
#: The dtype matrix of the per-op tests; the property test below draws from every dtype in ``DTYPES``.
MATRIX_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)
#: Direct exchanges and binomial trees only.
DIRECT = Tuning(small_bytes=1 << 40)


def tuning(path: str, dtype: torch.dtype) -> Tuning:
    """``direct``/``tree``: the small paths; ``ring``/``chain``: rings and chains for every
    non-empty tensor, moving segments of three elements and reducing two at a time."""
    if path in ("direct", "tree"):
        return DIRECT
    return Tuning(small_bytes=0, segment_bytes=3 * dtype.itemsize, serial_elems=2)


def roots(size: int) -> list[int]:
    return sorted({0, 1 % size, size // 2, size - 1})


SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (7,), (37,), (3, 5))
WAIT_S = 10.0


@pytest.fixture(autouse=True, scope="module")
def _calm_threads() -> Iterator[None]:
    """Thread-ranks hand thousands of tiny messages to each other. Every rank blocks on
    its queue soon enough, so forced GIL switches (futex storms with eight ranks on two
    cores) only cost time: make them rarer. And keep torch's own thread pool asleep."""
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(0.01)
    torch.set_num_threads(1)
    yield
    sys.setswitchinterval(interval)
    torch.set_num_threads(threads)


# -- the in-process fabric ------------------------------------------------------------


class ProtocolError(AssertionError):
    """The algorithm broke a rule of the Channel contract."""


class PeerAborted(Exception):
    """Another rank failed first; this one stops waiting."""


class Fabric:
    """The wires between ``size`` thread-ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[tuple[int, int], queue.SimpleQueue[torch.Tensor]] = {
            (s, d): queue.SimpleQueue() for s in range(size) for d in range(size) if s != d
        }
        self.failed = threading.Event()
        self.messages = [0] * size  # sent, per rank
        self.max_message_bytes = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a rank starts or stops waiting
        self.waiting: set[int] = set()  # ranks blocked in a receive right now

    def leftovers(self) -> dict[tuple[int, int], int]:
        return {pair: q.qsize() for pair, q in self.queues.items() if not q.empty()}


class ThreadChannel:
    """A strict, eager :class:`pg_core.algorithms.Channel` over a :class:`Fabric`."""

    def __init__(self, fabric: Fabric, rank: int) -> None:
        self.fabric = fabric
        self.rank = rank
        self.size = fabric.size
        self._irecvs: dict[int, deque[tuple[torch.Tensor, Work]]] = {}
        self._sends: dict[Work, tuple[torch.Tensor, torch.Tensor]] = {}  # pending isend -> (buffer, snapshot)
        self._recvs: dict[Work, int] = {}  # pending irecv -> peer

    def _check_peer(self, peer: int) -> None:
        if not (0 <= peer < self.size) or peer == self.rank:
            raise ProtocolError(f"rank {self.rank}: invalid peer {peer} in a group of {self.size}")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._check_peer(peer)
        if not tensor.is_contiguous():
            raise ProtocolError(f"rank {self.rank}: sends must be contiguous")
        with self.fabric.lock:
            self.fabric.messages[self.rank] += 1
            self.fabric.max_message_bytes = max(self.fabric.max_message_bytes, tensor.nbytes)
        self.fabric.queues[(self.rank, peer)].put(tensor.detach().clone())

    def _take(self, peer: int) -> torch.Tensor:
        q = self.fabric.queues[(peer, self.rank)]
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        with self.fabric.changed:
            self.fabric.waiting.add(self.rank)
            self.fabric.changed.notify_all()
        try:
            return self._wait(q, peer)
        finally:
            with self.fabric.changed:
                self.fabric.waiting.discard(self.rank)
                self.fabric.changed.notify_all()

    def _wait(self, q: queue.SimpleQueue[torch.Tensor], peer: int) -> torch.Tensor:
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.fabric.failed.is_set():
                raise PeerAborted
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"rank {self.rank}: nothing from {peer} in {WAIT_S} s") from None

    def _check_message(self, message: torch.Tensor, tensor: torch.Tensor, peer: int) -> None:
        if message.dtype != tensor.dtype or message.numel() != tensor.numel():
            raise ProtocolError(
                f"rank {self.rank}: message from {peer} is {message.numel()} x {message.dtype}, "
                f"the receive expects {tensor.numel()} x {tensor.dtype}"
            )

    def _deliver(self, tensor: torch.Tensor, peer: int) -> None:
        message = self._take(peer)
        self._check_message(message, tensor, peer)
        tensor.copy_(message.reshape(tensor.shape))

    def _drain(self, peer: int, until: Work | None = None) -> None:
        """Complete posted irecvs from ``peer`` in posting order (up to ``until``)."""
        pending = self._irecvs.get(peer)
        while pending:
            tensor, work = pending.popleft()
            self._deliver(tensor, peer)
            work.set_result(None)
            if work is until:
                return

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self._check_peer(peer)
        self._drain(peer)  # earlier irecvs from this peer match first
        self._deliver(tensor, peer)

    def isend(self, tensor: torch.Tensor, peer: int) -> Work:
        self.send(tensor, peer)
        work = Work("isend")
        self._sends[work] = (tensor, tensor.detach().clone())
        return work

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work:
        """Delivers at once when the message is already here (the earliest a transport may),
        otherwise at ``wait`` or at a later receive from ``peer`` (the latest)."""
        self._check_peer(peer)
        if tensor.numel() and tensor.dtype != torch.bool:
            tensor.fill_(float("nan") if tensor.is_floating_point() or tensor.is_complex() else 77)
        work = Work("irecv")
        self._recvs[work] = peer
        pending = self._irecvs.setdefault(peer, deque())
        if not pending:
            try:
                message = self.fabric.queues[(peer, self.rank)].get_nowait()
            except queue.Empty:
                pass
            else:
                self._check_message(message, tensor, peer)
                tensor.copy_(message.reshape(tensor.shape))
                work.set_result(None)
                return work
        pending.append((tensor, work))
        return work

    def sendrecv(self, send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int) -> None:
        work = self.isend(send_tensor, dst)
        self.recv(recv_tensor, src)
        self.wait(work)

    def wait(self, work: Work) -> None:
        sent = self._sends.pop(work, None)
        peer = self._recvs.pop(work, None)
        if sent is not None:
            buffer, snapshot = sent
            if not same_bits(buffer, snapshot):
                raise ProtocolError(f"rank {self.rank}: an isend buffer changed before wait()")
            work.set_result(None)
        elif peer is not None:
            if not work.is_completed():
                self._drain(peer, until=work)
        else:
            raise ProtocolError(f"rank {self.rank}: wait() on a work that is not pending here")
        work.wait(0)

    def check_idle(self) -> None:
        if self._sends or self._recvs:
            raise ProtocolError(f"rank {self.rank}: {len(self._sends) + len(self._recvs)} isend/irecv never waited")


def run_ranks(size: int, fn: Callable[[ThreadChannel], Any], *, fabric: Fabric | None = None) -> list[Any]:
    """Run ``fn(channel)`` on ``size`` thread-ranks; return each rank's result, re-raise the first failure."""
    fabric = fabric or Fabric(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        channel = ThreadChannel(fabric, rank)
        try:
            results[rank] = fn(channel)
            channel.check_idle()
        except BaseException as exc:
            errors[rank] = exc
            fabric.failed.set()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 3)
    if any(thread.is_alive() for thread in threads):
        raise AssertionError("a rank hung")
    for exc in errors:
        if exc is not None and not isinstance(exc, PeerAborted):
            raise exc
    assert not fabric.leftovers(), f"messages never received: {fabric.leftovers()}"
    return results


# -- data and references ---------------------------------------------------------------


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    ops = [ReduceOp(t) for t in RedOpType if t is not RedOpType.PREMUL_SUM and t in default_reduce_ops(dtype)]
    if RedOpType.PREMUL_SUM in default_reduce_ops(dtype):
        ops += [ReduceOp.premul_sum(0.5), ReduceOp.premul_sum(torch.tensor(3.0))]
    return ops


def exact_data(
    rank: int, shape: Sequence[int], dtype: torch.dtype, op: ReduceOp | None = None, seed: int = 0
) -> torch.Tensor:
    """Values whose sums and products are exact in every dtype (so any order gives the same bits)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 1)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        if op is not None and op.type is RedOpType.PRODUCT:
            choices = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
            real = choices[torch.randint(0, 6, shape, generator=g)]
            if dtype.is_complex:
                turn = torch.tensor([1, 1j, -1, -1j], dtype=torch.complex128)[torch.randint(0, 4, shape, generator=g)]
                return (real * turn).to(dtype)
            return real.to(dtype)
        real = torch.randint(-8, 9, shape, generator=g).double() / 4
        if dtype.is_complex:
            imag = torch.randint(-8, 9, shape, generator=g).double() / 4
            return torch.complex(real, imag).to(dtype)
        return real.to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def wide(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return t.to(torch.complex128)
    if t.is_floating_point():
        return t.to(torch.float64)
    return t


_REF = {
    RedOpType.SUM: torch.add,
    RedOpType.AVG: torch.add,
    RedOpType.PREMUL_SUM: torch.add,
    RedOpType.PRODUCT: torch.mul,
    RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum,
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}


def reference(xs: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction in float64/complex128 (floats), or exactly in the dtype (ints wrap like the dtype)."""
    ys = [wide(x) for x in xs]
    if op.type is RedOpType.PREMUL_SUM:
        ys = [y * op.factor_value() for y in ys]
    acc = ys[0].clone()
    for y in ys[1:]:
        acc = _REF[op.type](acc, y)
    if op.type is RedOpType.AVG:
        acc = acc / len(xs)
    return acc


def eps(dtype: torch.dtype) -> float:
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    return torch.finfo(dtype).eps


def assert_reduced(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == dtype, what
    if dtype.is_floating_point or dtype.is_complex:
        # The exact data makes every result exact up to the final rounding (AVG, premul).
        e = eps(dtype)
        torch.testing.assert_close(wide(actual), expected, rtol=e, atol=e, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected.reshape(actual.shape)), f"{what}: {actual} != {expected}"


def id_of(value: object) -> str:
    return str(value).replace("torch.", "")


# -- all_reduce --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ("direct", "ring"))
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_all_reduce(size: int, dtype: torch.dtype, path: str) -> None:
    ops = ops_for(dtype)
    # every op on the short shapes; the long one (many ring segments) and a 2-d one for two ops
    cases = [(op, shape) for op in ops for shape in ((), (0,), (7,))]
    cases += [(op, shape) for op in (ops[0], ops[-1]) for shape in ((37,), (3, 5))]

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        out = []
        for op, shape in cases:
            t = exact_data(ch.rank, shape, dtype, op)
            algorithms.all_reduce(ch, t, op, tuning=tuning(path, dtype))
            out.append(t)
        return out

    results = run_ranks(size, body)
    for i, (op, shape) in enumerate(cases):
        expected = reference([exact_data(r, shape, dtype, op) for r in range(size)], op)
        for rank in range(size):
            assert results[rank][i].shape == shape
            assert_reduced(results[rank][i], expected, dtype, f"{op} {shape} rank {rank}")
            assert same_bits(results[rank][i], results[0][i]), f"{op} {shape}: rank {rank} differs from rank 0"


def random_floats(rank: int, numel: int, dtype: torch.dtype, seed: int = 0, op: ReduceOp | None = None) -> torch.Tensor:
    """Random values: normal (times 10), or for PRODUCT factors of magnitude 0.7 .. 1.4 (no overflow)."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    if op is not None and op.type is RedOpType.PRODUCT:
        magnitude = torch.rand(numel, dtype=torch.float64, generator=g) * 0.7 + 0.7
        angle = torch.rand(numel, dtype=torch.float64, generator=g) * 2 * torch.pi
        if dtype.is_complex:
            return torch.polar(magnitude, angle).to(dtype)
        return (magnitude * torch.sign(angle - torch.pi)).to(dtype)
    if dtype.is_complex:
        return torch.randn(numel, dtype=torch.complex128, generator=g).to(dtype)
    return (torch.randn(numel, dtype=torch.float64, generator=g) * 10).to(dtype)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.complex64)
ROUNDING_OPS = (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM, RedOpType.PRODUCT)


@pytest.mark.parametrize("path", ("direct", "ring"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", (2, 3, 5, 8))
def test_all_reduce_rounding_is_identical_on_every_rank(size: int, dtype: torch.dtype, path: str) -> None:
    """Random data rounds differently in every order: the bits agree only if each element is reduced once."""
    numel = 53
    ops = [op for op in ops_for(dtype) if op.type in ROUNDING_OPS]

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        out = []
        for op in ops:
            t = random_floats(ch.rank, numel, dtype, op=op)
            algorithms.all_reduce(ch, t, op, tuning=tuning(path, dtype))
            out.append(t)
        return out

    results = run_ranks(size, body)
    for i, op in enumerate(ops):
        for rank in range(1, size):
            assert same_bits(results[rank][i], results[0][i]), f"{op}: rank {rank} differs from rank 0"
        xs = [random_floats(r, numel, dtype, op=op) for r in range(size)]
        expected = reference(xs, op)
        if op.type is RedOpType.PRODUCT:  # relative error of ``size`` roundings (complex: a few ulps each)
            bound = expected.abs() * eps(dtype) * size * 4
        else:  # summation error bound
            factor = abs(op.factor_value()) if op.type is RedOpType.PREMUL_SUM else 1.0
            bound = sum(wide(x).abs() for x in xs) * factor * eps(dtype) * size + 1e-6
        assert bool(((wide(results[0][i]) - expected).abs() <= bound).all()), f"{op}: outside the rounding bound"


@pytest.mark.parametrize("path", ("direct", "ring"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=id_of)
@pytest.mark.parametrize("size", (2, 3, 4))
def test_all_reduce_signed_zeros_and_nans_agree_bitwise(size: int, dtype: torch.dtype, path: str) -> None:
    """``minimum(-0., 0.)`` and a sum of NaNs depend on the operand order: every rank must use the same one."""
    zero = torch.tensor([-0.0 if r % 2 else 0.0 for r in range(size)])
    nan = torch.tensor(float("nan"))
    ops = [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.PRODUCT]

    def data(rank: int) -> torch.Tensor:
        zeros = zero.roll(rank)  # rank r: a +0/-0 pattern that differs from its neighbours'
        nans = torch.stack([nan.copysign(torch.tensor(-1.0 if (rank + k) % 2 else 1.0)) for k in range(size)])
        return torch.cat([zeros, nans, zeros]).to(dtype)

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        out = []
        for op in ops:
            t = data(ch.rank)
            algorithms.all_reduce(ch, t, op, tuning=tuning(path, dtype))
            out.append(t)
        return out

    results = run_ranks(size, body)
    for i, op in enumerate(ops):
        for rank in range(1, size):
            assert same_bits(results[rank][i], results[0][i]), f"{op}: rank {rank} differs from rank 0"


@pytest.mark.parametrize("size", (2, 3, 4, 8))
def test_direct_all_reduce_folds_in_rank_order(size: int) -> None:
    """The small path is ``((x0 + x1) + x2) + ...`` in the dtype: the same bits as a sequential fold."""
    xs = [random_floats(r, 29, torch.float16, seed=5) for r in range(size)]

    def body(ch: ThreadChannel) -> torch.Tensor:
        t = xs[ch.rank].clone()
        algorithms.all_reduce(ch, t, ReduceOp.SUM, tuning=DIRECT)
        return t

    results = run_ranks(size, body)
    expected = xs[0].clone()
    for x in xs[1:]:
        expected = expected + x
    for rank in range(size):
        assert same_bits(results[rank], expected)


def test_all_reduce_default_tuning_large_and_small() -> None:
    """Past the default ``small_bytes`` the ring runs (uneven chunks) and still matches."""
    numel = algorithms.DEFAULT_TUNING.small_bytes // 4 + 11
    for size in (2, 3):
        for n in (numel, 5):
            results = run_ranks(size, lambda ch, n=n: _all_reduce_ret(ch, exact_data(ch.rank, (n,), torch.float32)))
            expected = reference([exact_data(r, (n,), torch.float32) for r in range(size)], ReduceOp.SUM)
            for t in results:
                assert_reduced(t, expected, torch.float32, f"size {size} numel {n}")


def _all_reduce_ret(ch: ThreadChannel, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM, **kw: Any) -> torch.Tensor:
    algorithms.all_reduce(ch, t, op, **kw)
    return t


def test_small_all_reduce_sends_one_message_per_peer() -> None:
    for size in (2, 3, 5):
        fabric = Fabric(size)
        run_ranks(size, lambda ch: _all_reduce_ret(ch, torch.ones(3)), fabric=fabric)
        assert fabric.messages == [size - 1] * size


def test_ring_messages_are_segments() -> None:
    """The ring's reduce-scatter moves segments of at most ``segment_bytes``; its all-gather moves blocks."""
    size, numel = 4, 1000
    tune = Tuning(small_bytes=0, segment_bytes=64)
    fabric = Fabric(size)
    run_ranks(
        size,
        lambda ch: algorithms.reduce_scatter_tensor(
            ch, torch.empty(numel // size), torch.ones(numel), ReduceOp.SUM, tuning=tune
        ),
        fabric=fabric,
    )
    assert fabric.max_message_bytes == 64
    assert fabric.messages == [(size - 1) * -(-(numel // size) // 16)] * size


def test_all_reduce_of_a_tensor_that_requires_grad() -> None:
    def body(ch: ThreadChannel) -> torch.Tensor:
        p = torch.full((4,), float(ch.rank + 1), requires_grad=True)
        algorithms.all_reduce(ch, p, ReduceOp.SUM)
        algorithms.broadcast(ch, p, 0)
        return p.detach()

    for t in run_ranks(3, body):
        assert t.tolist() == [6.0] * 4


def test_a_size_mismatch_is_caught_not_hidden() -> None:
    """The double (and so these tests) sees ranks disagreeing on the message size."""
    with pytest.raises(ProtocolError, match="message from"):
        run_ranks(2, lambda ch: _all_reduce_ret(ch, torch.ones(3 + ch.rank)))


# -- broadcast and reduce -------------------------------------------------------------------


@pytest.mark.parametrize("path", ("tree", "chain"))
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_broadcast(size: int, dtype: torch.dtype, path: str) -> None:
    cases = [(src, shape) for src in roots(size) for shape in SHAPES]

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        out = []
        for src, shape in cases:
            t = exact_data(ch.rank, shape, dtype, seed=src)
            algorithms.broadcast(ch, t, src, tuning=tuning(path, dtype))
            out.append(t)
        return out

    results = run_ranks(size, body)
    for i, (src, shape) in enumerate(cases):
        expected = exact_data(src, shape, dtype, seed=src)
        for rank in range(size):
            assert same_bits(results[rank][i], expected), f"src {src} shape {shape} rank {rank}"


@pytest.mark.parametrize("path", ("tree", "chain"))
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_reduce(size: int, dtype: torch.dtype, path: str) -> None:
    shapes = ((), (0,), (11,))
    cases = [(op, dst, shape) for op in ops_for(dtype) for dst in roots(size) for shape in shapes]

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        out = []
        for op, dst, shape in cases:
            t = exact_data(ch.rank, shape, dtype, op)
            algorithms.reduce(ch, t, dst, op, tuning=tuning(path, dtype))
            out.append(t)
        return out

    results = run_ranks(size, body)
    for i, (op, dst, shape) in enumerate(cases):
        xs = [exact_data(r, shape, dtype, op) for r in range(size)]
        assert_reduced(results[dst][i], reference(xs, op), dtype, f"{op} dst {dst} shape {shape}")
        for rank in range(size):
            if rank != dst:
                assert same_bits(results[rank][i], xs[rank]), f"{op}: rank {rank} (not dst) changed its tensor"


def test_chain_and_tree_are_both_used() -> None:
    """The chain takes over only where it is faster, so both paths above really ran."""
    assert algorithms._prefer_chain(8, -(-37 // 3))
    assert algorithms._prefer_chain(3, 2)
    assert not algorithms._prefer_chain(8, 1)
    assert not algorithms._prefer_chain(2, 100)


# -- gathers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ("direct", "ring"))
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_all_gather_and_into_tensor(size: int, dtype: torch.dtype, path: str) -> None:
    tune = tuning(path, dtype)

    def body(ch: ThreadChannel) -> list[Any]:
        out: list[Any] = []
        for shape in SHAPES:
            mine = exact_data(ch.rank, shape, dtype)
            before = mine.clone()
            outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
            algorithms.all_gather(ch, outs, mine, tuning=tune)
            assert same_bits(mine, before)
            flat = torch.empty((size * mine.numel(),), dtype=dtype)
            algorithms.all_gather_into_tensor(ch, flat, mine, tuning=tune)
            # in place: the input is this rank's block of the output
            inplace = torch.empty((size, *shape), dtype=dtype)
            inplace[ch.rank].copy_(mine)
            algorithms.all_gather_into_tensor(ch, inplace, inplace[ch.rank], tuning=tune)
            out.append((outs, flat, inplace))
        return out

    results = run_ranks(size, body)
    for i, shape in enumerate(SHAPES):
        xs = [exact_data(r, shape, dtype) for r in range(size)]
        concat = torch.cat([x.reshape(-1) for x in xs])
        for rank in range(size):
            outs, flat, inplace = results[rank][i]
            for peer in range(size):
                assert same_bits(outs[peer], xs[peer]), f"shape {shape} rank {rank} peer {peer}"
            assert same_bits(flat, concat)
            assert same_bits(inplace.reshape(-1), concat)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bool, torch.int64), ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_gather_and_scatter(size: int, dtype: torch.dtype) -> None:
    def body(ch: ThreadChannel) -> list[Any]:
        out: list[Any] = []
        for root in range(size):
            for shape in ((), (0,), (6,), (2, 3)):
                mine = exact_data(ch.rank, shape, dtype, seed=root)
                before = mine.clone()
                glist = [torch.empty(shape, dtype=dtype) for _ in range(size)] if ch.rank == root else None
                algorithms.gather(ch, mine, glist, root)
                assert same_bits(mine, before)
                slist = [exact_data(100 + r, shape, dtype, seed=root) for r in range(size)] if ch.rank == root else None
                slist_before = [s.clone() for s in slist] if slist is not None else None
                got = torch.empty(shape, dtype=dtype)
                algorithms.scatter(ch, got, slist, root)
                if slist is not None and slist_before is not None:
                    assert all(same_bits(a, b) for a, b in zip(slist, slist_before))
                out.append((root, shape, glist, got))
        return out

    results = run_ranks(size, body)
    for rank in range(size):
        for root, shape, glist, got in results[rank]:
            assert same_bits(got, exact_data(100 + rank, shape, dtype, seed=root))
            if rank == root:
                for peer in range(size):
                    assert same_bits(glist[peer], exact_data(peer, shape, dtype, seed=root))
            else:
                assert glist is None


# -- reduce_scatter ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ("direct", "ring"))
@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter(size: int, dtype: torch.dtype, path: str) -> None:
    tune = tuning(path, dtype)
    ops = ops_for(dtype)
    cases = [(op, numel) for op in ops for numel in (0, 5)] + [(ops[0], 1), (ops[-1], 13)]
    variants = (ops[0], ops[-1]) if size < 8 else (ops[-1],)  # the list and in-place forms, for two ops

    def body(ch: ThreadChannel) -> list[Any]:
        out: list[Any] = []
        for op, numel in cases:
            full = exact_data(ch.rank, (size * numel,), dtype, op)
            before = full.clone()
            a = torch.empty(numel, dtype=dtype)
            algorithms.reduce_scatter_tensor(ch, a, full, op, tuning=tune)
            assert same_bits(full, before), f"{op}: the input changed"
            got = [a]
            if op in variants:
                pieces = [full[k * numel : (k + 1) * numel].clone() for k in range(size)]
                b = torch.empty(numel, dtype=dtype)
                algorithms.reduce_scatter(ch, b, pieces, op, tuning=tune)
                assert all(same_bits(p, q) for p, q in zip(pieces, full.split(max(numel, 1)))), f"{op}: input changed"
                # in place: the output is this rank's block of the input
                inplace = full.clone()
                mine = inplace[ch.rank * numel : (ch.rank + 1) * numel]
                algorithms.reduce_scatter_tensor(ch, mine, inplace, op, tuning=tune)
                got += [b, mine]
            out.append(got)
        return out

    results = run_ranks(size, body)
    for i, (op, numel) in enumerate(cases):
        expected = reference([exact_data(r, (size * numel,), dtype, op) for r in range(size)], op)
        for rank in range(size):
            block = expected[rank * numel : (rank + 1) * numel]
            for got in results[rank][i]:
                assert_reduced(got, block, dtype, f"{op} numel {numel} rank {rank}")


@pytest.mark.parametrize("size", (2, 3, 5, 8))
def test_direct_reduce_scatter_is_a_slice_of_direct_all_reduce(size: int) -> None:
    """Both small paths fold in rank order, so their bits agree element for element."""
    numel = 11

    def body(ch: ThreadChannel) -> tuple[torch.Tensor, torch.Tensor]:
        full = random_floats(ch.rank, size * numel, torch.bfloat16, seed=3)
        block = torch.empty(numel, dtype=torch.bfloat16)
        algorithms.reduce_scatter_tensor(ch, block, full, ReduceOp.AVG, tuning=DIRECT)
        algorithms.all_reduce(ch, full, ReduceOp.AVG, tuning=DIRECT)
        return block, full

    for rank, (block, full) in enumerate(run_ranks(size, body)):
        assert same_bits(block, full[rank * numel : (rank + 1) * numel])


# -- all_to_all ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.complex128, torch.bool, torch.int16), ids=id_of)
@pytest.mark.parametrize("size", SIZES)
def test_all_to_all(size: int, dtype: torch.dtype) -> None:
    def count(src: int, dst: int) -> int:  # uneven, with zero-size pieces
        return (src * 3 + dst * 5) % 4

    def piece(src: int, dst: int) -> torch.Tensor:
        return exact_data(src * 100 + dst, (count(src, dst), 2), dtype)

    def body(ch: ThreadChannel) -> tuple[list[torch.Tensor], torch.Tensor]:
        r = ch.rank
        inputs = [piece(r, d) for d in range(size)]
        before = [t.clone() for t in inputs]
        outputs = [torch.empty((count(s, r), 2), dtype=dtype) for s in range(size)]
        algorithms.all_to_all(ch, outputs, inputs)
        assert all(same_bits(a, b) for a, b in zip(inputs, before))
        single_in = torch.cat(inputs)
        single_out = torch.empty((sum(count(s, r) for s in range(size)), 2), dtype=dtype)
        algorithms.all_to_all_single(
            ch, single_out, single_in, [count(s, r) for s in range(size)], [count(r, d) for d in range(size)]
        )
        assert same_bits(single_in, torch.cat(before))
        return outputs, single_out

    for r, (outputs, single_out) in enumerate(run_ranks(size, body)):
        for s in range(size):
            assert same_bits(outputs[s], piece(s, r)), f"rank {r} from {s}"
        assert same_bits(single_out, torch.cat([piece(s, r) for s in range(size)]))


def test_all_to_all_single_in_place_and_even() -> None:
    size = 4

    def body(ch: ThreadChannel) -> torch.Tensor:
        t = torch.arange(size * 3, dtype=torch.int32).reshape(size, 3) + 100 * ch.rank
        algorithms.all_to_all_single(ch, t, t, [1] * size, [1] * size)
        return t

    for r, t in enumerate(run_ranks(size, body)):
        expected = torch.stack([torch.arange(r * 3, r * 3 + 3, dtype=torch.int32) + 100 * s for s in range(size)])
        assert torch.equal(t, expected)


# -- barrier -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_barrier_waits_for_the_last_rank(size: int) -> None:
    for late in {0, size - 1, size // 2}:
        fabric = Fabric(size)
        entered = [False] * size
        done: set[int] = set()

        def body(ch: ThreadChannel, late: int = late, entered: list[bool] = entered, done: set[int] = done) -> bool:
            if ch.rank == late:
                # enter only once every other rank is blocked in the barrier or has (wrongly) left it
                others = set(range(size)) - {late}
                with fabric.changed:
                    fabric.changed.wait_for(lambda: others <= fabric.waiting | done, timeout=WAIT_S)
            entered[ch.rank] = True
            algorithms.barrier(ch)
            left_after_late = all(entered)
            with fabric.changed:
                done.add(ch.rank)
                fabric.changed.notify_all()
            return left_after_late

        assert all(run_ranks(size, body, fabric=fabric)), f"a rank left the barrier before rank {late} entered"


# -- tuning, hypothesis, and the Backend defaults ---------------------------------------------------


def test_tuning_validates() -> None:
    with pytest.raises(ValueError, match="small_bytes"):
        Tuning(small_bytes=-1)
    with pytest.raises(ValueError, match="segment_bytes"):
        Tuning(segment_bytes=0)
    with pytest.raises(ValueError, match="pipeline"):
        Tuning(pipeline=0)
    with pytest.raises(ValueError, match="serial_elems"):
        Tuning(serial_elems=1.5)  # type: ignore[arg-type]
    assert Tuning(segment_bytes=3).segment_elems(8) == 1
    with pytest.raises(AttributeError):
        algorithms.DEFAULT_TUNING.small_bytes = 1  # type: ignore[misc]


def test_combine_() -> None:
    acc = torch.tensor([1, 6, 3])
    algorithms.combine_(acc, torch.tensor([4, 2, 3]), RedOpType.MAX)
    assert acc.tolist() == [4, 6, 3]
    algorithms.combine_(acc, torch.tensor([1, 1, 1]), RedOpType.SUM)
    assert acc.tolist() == [5, 7, 4]


@st.composite
def collective_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    size = draw(st.sampled_from(SIZES))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(ops_for(dtype)))
    numel = draw(st.integers(0, 40))
    root = draw(st.integers(0, size - 1))
    tune = Tuning(
        small_bytes=draw(st.sampled_from([0, 64, 1 << 20])),
        segment_bytes=draw(st.integers(1, 48)),
        pipeline=draw(st.integers(1, 5)),
        serial_elems=draw(st.integers(0, 4)),
    )
    return size, dtype, op, numel, root, tune


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collective_cases())
def test_collectives_agree_with_the_reference(case: tuple[Any, ...]) -> None:
    size, dtype, op, numel, root, tune = case

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        r = ch.rank
        a = exact_data(r, (numel,), dtype, op)
        algorithms.all_reduce(ch, a, op, tuning=tune)
        b = exact_data(r, (numel,), dtype, op)
        algorithms.reduce(ch, b, root, op, tuning=tune)
        c = exact_data(r, (numel,), dtype, op, seed=1)
        algorithms.broadcast(ch, c, root, tuning=tune)
        d = torch.empty(numel, dtype=dtype)
        algorithms.reduce_scatter_tensor(ch, d, exact_data(r, (size * numel,), dtype, op, seed=2), op, tuning=tune)
        e = torch.empty(size * numel, dtype=dtype)
        algorithms.all_gather_into_tensor(ch, e, exact_data(r, (numel,), dtype, seed=3), tuning=tune)
        return [a, b, c, d, e]

    results = run_ranks(size, body)
    expected_all = reference([exact_data(r, (numel,), dtype, op) for r in range(size)], op)
    expected_rs = reference([exact_data(r, (size * numel,), dtype, op, seed=2) for r in range(size)], op)
    gathered = torch.cat([exact_data(r, (numel,), dtype, seed=3) for r in range(size)])
    for r, (a, b, c, d, e) in enumerate(results):
        assert_reduced(a, expected_all, dtype, "all_reduce")
        assert same_bits(a, results[0][0])
        if r == root:
            assert_reduced(b, expected_all, dtype, "reduce")
        else:
            assert same_bits(b, exact_data(r, (numel,), dtype, op))
        assert same_bits(c, exact_data(root, (numel,), dtype, op, seed=1))
        assert_reduced(d, expected_rs[r * numel : (r + 1) * numel], dtype, "reduce_scatter_tensor")
        assert same_bits(e, gathered)


class QueueBackend(Backend):
    """A backend with only ``send`` and ``recv``: the core's defaults do the rest."""

    fabric: Fabric

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, timeout: float) -> None:
        self.fabric.queues[(self.rank, dst)].put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, tag: int, *, timeout: float) -> None:
        try:
            message = self.fabric.queues[(src, self.rank)].get(timeout=timeout)
        except queue.Empty:
            raise CollectiveTimeout(f"recv from {src} timed out") from None
        assert message.numel() == tensor.numel() and message.dtype == tensor.dtype
        tensor.copy_(message.reshape(tensor.shape))


@pytest.mark.parametrize("size", (1, 3, 4))
def test_backend_defaults_run_on_send_and_recv_only(size: int) -> None:
    """Through ``BackendChannel`` and the default thread-backed isend/irecv, rings included."""
    fabric = Fabric(size)

    def body(ch: ThreadChannel) -> list[torch.Tensor]:
        ctx = BackendContext(
            store=None,  # type: ignore[arg-type]
            rank=ch.rank,
            size=size,
            device=torch.device("cpu"),
            timeout=WAIT_S,
            group_name="test",
            group_uid="test-0",
            backend_name="queue",
        )
        backend = QueueBackend(ctx)
        backend.fabric = fabric
        try:
            big = exact_data(ch.rank, (algorithms.DEFAULT_TUNING.small_bytes // 8 + 3,), torch.float64)
            backend.all_reduce(big, ReduceOp.SUM, timeout=WAIT_S)
            small = exact_data(ch.rank, (5,), torch.float32)
            backend.all_reduce(small, ReduceOp.MAX, timeout=WAIT_S)
            out = torch.empty(size * 5, dtype=torch.float32)
            backend.all_gather_into_tensor(out, exact_data(ch.rank, (5,), torch.float32), timeout=WAIT_S)
            backend.barrier(timeout=WAIT_S)
            return [big, small, out]
        finally:
            backend.shutdown()

    results = run_ranks(size, body, fabric=fabric)
    big_ref = reference([exact_data(r, (results[0][0].numel(),), torch.float64) for r in range(size)], ReduceOp.SUM)
    small_ref = reference([exact_data(r, (5,), torch.float32) for r in range(size)], ReduceOp.MAX)
    for big, small, out in results:
        assert_reduced(big, big_ref, torch.float64, "big all_reduce")
        assert_reduced(small, small_ref, torch.float32, "small all_reduce")
        assert same_bits(out, torch.cat([exact_data(r, (5,), torch.float32) for r in range(size)]))


# -- run and launch: the two forms of an algorithm's steps ---------------------------------


class _HandChannel:
    """A channel whose works the test completes by hand (as a transport's progress would)."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.waited: list[Work] = []

    def wait(self, work: Work) -> None:
        self.waited.append(work)
        work.wait(WAIT_S)


def test_launch_runs_to_the_first_pending_work_here_and_the_rest_where_works_complete() -> None:
    ch = _HandChannel()
    first, second = Work("a"), Work("b")
    trace: list[tuple[str, int]] = []
    closed: list[bool] = []

    def steps() -> algorithms.Steps:
        try:
            trace.append(("start", threading.get_ident()))
            yield Work.completed("ready")  # complete already: no callback, straight on
            yield first
            trace.append(("after first", threading.get_ident()))
            yield second
            trace.append(("end", threading.get_ident()))
        finally:
            closed.append(True)

    outer = algorithms.launch(ch, steps(), "op")  # type: ignore[arg-type]
    assert trace == [("start", threading.get_ident())] and not outer.done
    completer = threading.Thread(target=first.set_result, args=(None,))
    completer.start()
    completer.join()
    assert trace[1] == ("after first", completer.ident) and not outer.done
    second.set_result(None)
    assert outer.wait(WAIT_S) is True and trace[-1] == ("end", threading.get_ident()) and closed == [True]


def test_launch_raises_what_fails_before_the_first_wait_and_fails_its_work_after() -> None:
    def bad_argument() -> algorithms.Steps:
        raise ValueError("gather: rank 0 is the destination and needs a gather_list")
        yield Work.completed()  # (a generator)

    with pytest.raises(ValueError, match="needs a gather_list"):
        algorithms.launch(_HandChannel(), bad_argument())  # type: ignore[arg-type]

    pending = Work("recv")
    closed: list[bool] = []

    def steps() -> algorithms.Steps:
        try:
            yield pending
            raise AssertionError("the steps went on after a failed work")
        finally:
            closed.append(True)

    outer = algorithms.launch(_HandChannel(), steps(), "op")  # type: ignore[arg-type]
    pending.set_exception(CollectiveTimeout("Timed out after 1 s in recv", op="recv"))
    with pytest.raises(CollectiveTimeout, match="Timed out after 1 s"):
        outer.wait(WAIT_S)
    assert closed == [True]


def test_run_waits_for_every_work_with_the_channels_wait() -> None:
    ch = _HandChannel()
    works = [Work.completed(str(i)) for i in range(3)]

    def steps() -> algorithms.Steps:
        yield from works

    algorithms.run(ch, steps())  # type: ignore[arg-type]
    assert ch.waited == works
