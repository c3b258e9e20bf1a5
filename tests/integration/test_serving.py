"""The serving pattern end to end, in real processes on one store.

Prefill workers A and B form group ``g1`` and keep it busy from a thread (an
``all_reduce`` loop that checks every result). Decode workers C and D start
later and know nothing of ``g1``, only the store. All four meet in ``g2``
through ``pg_core.rendezvous``; A sends C a tensor whose shape and dtype only A
knows, B sends D a kv-cache-like tensor dict, while ``g1`` keeps reducing; then
``g2`` splits into prefill and decode, and the decode pair also forms its own
subgroup with ``new_group``. Every process ends with no thread or socket of its
groups left open.

A second test covers latecomers: a process arriving at a full ``g2`` waits for
the next formation (and, alone, times out), and four more processes form that
next formation while the first ``g2`` is still alive.

Each process is this file run as a script (``python test_serving.py ROLE PORT``).
It reports to the test as JSON lines on stdout (``@@ {...}``) and takes commands
on stdin: that is the side channel that what a sender sent and what a receiver
got are compared through, and the only way the processes synchronise besides the
library itself. Every wait is bounded: per-operation timeouts in the processes, a
watchdog in each process, a deadline in the test, after which every process
still running dumps its stacks and is killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_core import CollectiveTimeout, ProcessGroup, TCPStore, rendezvous
from pg_core.testing.pool import leaks, resources

pytestmark = pytest.mark.requires_backend("tcp")  # in-repo: missing or broken fails, never skips

OP_TIMEOUT_S = 20.0  # every group operation in the processes
LONE_TIMEOUT_S = 2.0  # the latecomer that nobody joins
SCENARIO_LIMIT_S = 60.0  # the test's deadline for a whole scenario
CHILD_LIMIT_S = 90.0  # a process's own watchdog, for when the test itself is gone
PREFIX = "@@ "


# -- the test side --------------------------------------------------------------------------------


class Cluster:
    """The processes of one scenario: started, told, heard from, and always reaped."""

    def __init__(self, tmp_path: Path, limit_s: float) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.deadline = time.monotonic() + limit_s
        self._tmp = tmp_path
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._heard: dict[str, list[dict[str, Any]]] = {}
        self._last: dict[str, str] = {}  # each process's latest event, for the story of a failure
        self._done: set[str] = set()

    def start(self, role: str) -> None:
        """Start process ``role``; it learns the store's port and nothing else."""
        with open(self._tmp / f"{role}.stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, role, str(self.store.port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        self._procs[role] = proc
        threading.Thread(target=self._read, args=(role, proc.stdout), daemon=True).start()

    def _read(self, role: str, stdout: Any) -> None:
        for line in stdout:
            if line.startswith(PREFIX):
                try:
                    event = json.loads(line[len(PREFIX) :])
                except ValueError:
                    event = {"event": "error", "traceback": f"(an unreadable report: {line!r})"}
                self._events.put((role, event))
        self._events.put((role, {"event": "eof"}))

    def tell(self, role: str, command: str) -> None:
        stdin = self._procs[role].stdin
        assert stdin is not None
        try:
            stdin.write(command + "\n")
            stdin.flush()
        except OSError:
            self._fail(f"could not tell {role} {command!r}: it is gone", role)

    def expect(self, role: str, event: str) -> dict[str, Any]:
        """The next ``event`` from ``role``. Any process's error fails the test at once."""
        while True:
            heard = self._heard.get(role, [])
            for i, e in enumerate(heard):
                if e["event"] == event:
                    return heard.pop(i)
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                last = ", ".join(f"{r}: {self._last.get(r, '(nothing)')}" for r in self._procs)
                self._fail(
                    f"the scenario passed its {SCENARIO_LIMIT_S:g} s deadline waiting for {role}'s {event!r}; "
                    f"each process's last report: {last}"
                )
            try:
                who, e = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            self._last[who] = e["event"]
            if e["event"] == "error":
                self._fail(f"{who} raised:\n{e['traceback']}", who)
            if e["event"] == "eof" and who not in self._done:
                try:
                    code: int | str = self._procs[who].wait(timeout=max(1.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = "(unknown: it closed its stdout but is still running)"
                self._fail(f"{who} exited with {code} before it reported done (waiting for {role}'s {event!r})", who)
            if e["event"] == "done":
                self._done.add(who)
            self._heard.setdefault(who, []).append(e)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Every process's final report, once each exited 0."""
        reports = {role: self.expect(role, "done") for role in self._procs}
        for role, proc in self._procs.items():
            try:
                code = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._fail(f"{role} reported done but did not exit", role)
            if code != 0:
                self._fail(f"{role} reported done but exited with {code}", role)
        return reports

    def _fail(self, message: str, culprit: str | None = None) -> None:
        if culprit is not None:  # it reported its error and is on its way out: let it go quietly
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._procs[culprit].wait(timeout=5)
        # Every process still running dumps its threads' stacks (faulthandler, on SIGABRT) and dies.
        for proc in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGABRT)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        order = sorted(self._procs, key=lambda r: r != culprit)
        tails = "\n".join(f"--- {role} stderr (tail) ---\n{self._stderr(role)}" for role in order)
        raise AssertionError(f"{message}\n{tails}")

    def _stderr(self, role: str, limit: int = 6000) -> str:
        try:
            text = (self._tmp / f"{role}.stderr").read_bytes()[-limit:].decode(errors="replace")
        except OSError:
            return ""
        return text.strip() or "(empty)"

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, SCENARIO_LIMIT_S)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_serving_pattern(cluster: Cluster) -> None:
    cluster.start("A")
    cluster.start("B")
    for role in "AB":
        cluster.expect(role, "busy")  # g1 has completed all_reduces on both
    cluster.start("C")  # only now, and they are given the store's port, nothing about g1
    cluster.start("D")

    sent = cluster.expect("A", "sent")
    got = cluster.expect("C", "received")
    what = f"A's tensor (seed {sent['seed']}: {sent['dtype']} {sent['shape']}, contiguous={sent['contiguous']})"
    assert (got["dtype"], got["shape"], got["sha256"]) == (sent["dtype"], sent["shape"], sent["sha256"]), (
        f"C received {got} for {what}"
    )
    sent = cluster.expect("B", "sent")
    got = cluster.expect("D", "received")
    assert got["digest"] == sent["digest"], f"D received a different dict than B sent (seed {sent['seed']})"

    progressed = {}
    for sender, receiver in (("A", "C"), ("B", "D")):
        # Announced by the sender's g1 thread after its send, while its main thread waits for
        # the receiver's acknowledgement, which the receiver sends only when told: so g1 made
        # progress while this g2 exchange was under way.
        progressed[sender] = cluster.expect(sender, "g1-progressed")["count"]
        cluster.tell(receiver, "ack")

    reports = cluster.finish()
    orders = {tuple(reports[r]["g2_members"]) for r in "ABCD"}
    assert len(orders) == 1 and sorted(orders.pop()) == list("ABCD"), reports
    for role in "AB":
        c = reports[role]["g1_iterations"]
        assert c["before_g2"] <= c["before_traffic"] < progressed[role] <= c["after_traffic"], (role, c, progressed)
        assert c["after_traffic"] <= c["after_split"] <= c["end"], (role, c)
    assert reports["A"]["g1_iterations"]["end"] == reports["B"]["g1_iterations"]["end"]  # the loop stopped in step


@pytest.mark.timeout(120)
def test_latecomers_wait_for_the_next_formation(cluster: Cluster) -> None:
    firsts, lates = [f"P{i}" for i in range(4)], [f"Q{i}" for i in range(4)]
    for role in firsts + lates:
        cluster.start(role)  # the Q processes arrive at g2 only when told
    formed = [cluster.expect(role, "formed") for role in firsts]
    assert sorted(f["rank"] for f in formed) == [0, 1, 2, 3]
    assert {f["members"] for f in formed} == {0b1111}, formed  # each P sets bit 1 << i

    cluster.tell("Q0", "alone")  # g2 is full: Q0 waits for the next formation, and nobody else comes
    alone = cluster.expect("Q0", "alone")
    assert alone["error"] == "CollectiveTimeout", alone
    # its own timeout ended the wait (not the process's OP_TIMEOUT_S); no clock is read
    assert "1 of 4" in alone["message"], alone["message"]
    assert f"within {LONE_TIMEOUT_S:g} s" in alone["message"], alone["message"]
    assert "next formation" in alone["message"], alone["message"]

    for role in lates:
        cluster.tell(role, "join")
    formed = [cluster.expect(role, "formed") for role in lates]  # the first g2 has not shut down
    assert sorted(f["rank"] for f in formed) == [0, 1, 2, 3]
    assert {f["members"] for f in formed} == {0b11110000}, formed  # each Q sets bit 1 << (4 + i)

    for role in firsts:
        cluster.tell(role, "again")  # the first g2 still works, with its own members
    reports = cluster.finish()
    assert {reports[role]["members_again"] for role in firsts} == {0b1111}, reports


# -- the process side -------------------------------------------------------------------------------

_emit_lock = threading.Lock()


def _emit(event: str, **data: Any) -> None:
    with _emit_lock:
        print(PREFIX + json.dumps({"event": event, **data}), flush=True)


def _command(expected: str) -> None:
    line = sys.stdin.readline()
    if line.strip() != expected:
        raise RuntimeError(f"expected the command {expected!r} from the test, got {line!r}")


class ReduceLoop:
    """Keeps ``group`` busy from a thread: ``all_reduce`` after ``all_reduce``, every result
    checked. Each reduction also carries the ranks' stop requests, so the loop ends on every
    rank after the same iteration: the first one in which every rank has called ``stop()``."""

    def __init__(self, group: ProcessGroup) -> None:
        self._group = group
        self.count = 0
        self._cv = threading.Condition()
        self._stopping = False
        self._announce: tuple[int, str] | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"{group.name}-reduce-loop")
        self._thread.start()

    def _run(self) -> None:
        g = self._group
        base = torch.arange(256, dtype=torch.int64)
        try:
            for i in range(1 << 62):
                t = torch.cat([base * (g.rank + 1) + i, torch.tensor([int(self._stopping)])])
                g.all_reduce(t)
                expected = base * (g.size * (g.size + 1) // 2) + g.size * i
                if not torch.equal(t[:-1], expected):
                    raise AssertionError(f"{g.name}: all_reduce #{i} is wrong: {t[:8].tolist()}...")
                with self._cv:
                    self.count += 1
                    if self._announce is not None and self.count >= self._announce[0]:
                        _emit(self._announce[1], count=self.count)
                        self._announce = None
                    self._cv.notify_all()
                if t[-1].item() == g.size:
                    return
        except BaseException:
            self._error = traceback.format_exc()
            _emit("error", traceback=f"in the {g.name} loop:\n{self._error}")
            with self._cv:
                self._cv.notify_all()

    def wait_for(self, count: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.count >= count or self._error is not None, timeout=OP_TIMEOUT_S)
        if self._error is not None:
            raise AssertionError(f"the {self._group.name} loop failed:\n{self._error}")
        if self.count < count:
            raise AssertionError(f"the {self._group.name} loop did {self.count} of {count} iterations in time")

    def announce_at(self, count: int, event: str) -> None:
        """Have the loop's thread report ``event`` once it has done ``count`` iterations."""
        with self._cv:
            self._announce = (count, event)

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(timeout=OP_TIMEOUT_S)
        if self._thread.is_alive():
            raise AssertionError(f"the {self._group.name} loop did not stop within {OP_TIMEOUT_S:g} s")
        if self._error is not None:
            raise AssertionError(f"the {self._group.name} loop failed:\n{self._error}")


DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _random_tensor(seed: int) -> torch.Tensor:
    """A tensor of a shape and dtype drawn from ``seed``: 0-d and zero-element ones included,
    half of those with two dimensions or more a non-contiguous (transposed) view."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    shape = [rng.choice((0, 1, 2, 3, 5, 8, 13, 33, 64, 130, 517)) for _ in range(rng.randint(0, 4))]
    while torch.Size(shape).numel() > 1 << 18:
        shape[shape.index(max(shape))] //= 2
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=gen, dtype=dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    if t.dim() >= 2 and rng.random() < 0.5:
        t = t.transpose(0, t.dim() - 1)
    return t


def _kv_cache(seed: int) -> dict[str, Any]:
    """What a prefill worker hands a decode worker: kv blocks per layer and request metadata."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq, heads, head_dim = rng.randint(1, 48), 4, 16
    return {
        "request_id": f"req-{seed}",
        "seq_len": seq,
        "block_table": [rng.randrange(1000) for _ in range((seq + 15) // 16)],
        "sampling": {"temperature": 0.7, "top_p": None, "stop": ("</s>", "\n\n")},
        "kv": {
            layer: {
                "k": torch.randn(heads, seq, head_dim, generator=gen).to(torch.bfloat16),
                "v": torch.randn(heads, seq, head_dim, generator=gen).to(torch.float16),
            }
            for layer in range(rng.randint(1, 3))
        },
        "positions": torch.arange(seq),
        "attention_mask": torch.ones(seq, seq, dtype=torch.bool).tril(),
        "scale": torch.tensor(head_dim**-0.5),  # 0-d
        "prefix_hit": torch.empty(0, head_dim),  # zero elements
    }


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": _sha256(t), "contiguous": t.is_contiguous()}


def _digest(value: Any) -> Any:
    """A JSON-able description of a nested value, every tensor by dtype, shape and bytes."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), _sha256(value)]
    if isinstance(value, dict):
        return ["dict", [[repr(k), _digest(v)] for k, v in value.items()]]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_digest(v) for v in value]]
    return [type(value).__name__, repr(value)]


def _members(g2: ProcessGroup, me: str) -> dict[str, int]:
    """Who is who in g2 (ranks are in arrival order): role -> rank."""
    roles = g2.all_gather_object(me)
    assert roles[g2.rank] == me and sorted(roles) == list("ABCD"), roles
    return {role: rank for rank, role in enumerate(roles)}


def prefill(store: TCPStore, me: str) -> dict[str, Any]:
    """A or B: busy in g1 throughout; in g2, sends its decode partner what only it knows."""
    g1 = ProcessGroup(store, "AB".index(me), 2, name="g1", backends="tcp", timeout=OP_TIMEOUT_S)
    loop = ReduceLoop(g1)
    loop.wait_for(3)
    _emit("busy")
    counts = {"before_g2": loop.count}
    g2 = rendezvous(store, "g2", 4, backends="tcp", timeout=OP_TIMEOUT_S)
    rank = _members(g2, me)
    partner = rank["C" if me == "A" else "D"]
    counts["before_traffic"] = loop.count
    seed = random.SystemRandom().randrange(1 << 32)
    if me == "A":
        tensor = _random_tensor(seed)
        g2.send_tensor(tensor, partner)
        _emit("sent", seed=seed, **_describe(tensor))
    else:
        kv = _kv_cache(seed)
        g2.send_tensor_dict(kv, partner)
        _emit("sent", seed=seed, digest=_digest(kv))
    loop.announce_at(counts["before_traffic"] + 3, "g1-progressed")
    ack = g2.recv_object(partner)  # the partner acknowledges only when the test has seen g1-progressed
    assert ack == {"ok": True, "from": "C" if me == "A" else "D"}, ack
    counts["after_traffic"] = loop.count

    key = "AB".index(me)
    sub = g2.split(0, key)
    assert sub is not None and (sub.rank, sub.size) == (key, 2), sub
    assert sub.parent_ranks == (rank["A"], rank["B"]), (sub.parent_ranks, rank)
    t = torch.tensor([key + 1.0])
    sub.all_reduce(t)
    assert t.item() == 3.0, t
    counts["after_split"] = loop.count
    sub.shutdown()
    g2.shutdown()
    loop.stop()  # ends on both A and B after the first iteration in which both asked
    counts["end"] = loop.count
    g1.shutdown()
    return {"g1_iterations": counts, "g2_members": sorted(rank, key=rank.__getitem__)}


def decode(store: TCPStore, me: str) -> dict[str, Any]:
    """C or D: knows only the store; receives from its prefill partner, then works in the decode pair."""
    g2 = rendezvous(store, "g2", 4, backends="tcp", timeout=OP_TIMEOUT_S)
    rank = _members(g2, me)
    partner = rank["A" if me == "C" else "B"]
    if me == "C":
        t = g2.recv_tensor(partner)
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu", t
        _emit("received", **_describe(t))
    else:
        d = g2.recv_tensor_dict(partner)
        _emit("received", digest=_digest(d))
    _command("ack")
    g2.send_object({"ok": True, "from": me}, partner)

    key = "CD".index(me)
    pair = g2.split(1, key)
    assert pair is not None and (pair.rank, pair.size) == (key, 2), pair
    assert pair.parent_ranks == (rank["C"], rank["D"]), (pair.parent_ranks, rank)
    t = torch.tensor([10.0 * (key + 1)])
    pair.all_reduce(t)
    assert t.item() == 30.0, t
    if me == "C":
        pair.send_tensor_dict({"tokens": torch.tensor([17, 4, 99]), "step": 1}, 1)
    else:
        got = pair.recv_tensor_dict(0)
        assert got["step"] == 1 and torch.equal(got["tokens"], torch.tensor([17, 4, 99])), got

    # The same pair again, by new_group on g2: called by C and D only, ranks in the order given.
    order = [rank["D"], rank["C"]]
    own = g2.new_group(order)
    assert (own.rank, own.size) == ("DC".index(me), 2), own
    assert own.parent_ranks == tuple(order), (own.parent_ranks, order)
    other = 1 - own.rank
    if me == "D":
        own.send_object({"from": "D", "blocks": [3, 1, 4]}, other)
        reply = own.recv_object(other)
        assert reply == {"from": "C", "blocks": [1, 5, 9]}, reply
    else:
        got = own.recv_object(other)
        assert got == {"from": "D", "blocks": [3, 1, 4]}, got
        own.send_object({"from": "C", "blocks": [1, 5, 9]}, other)
    x = torch.tensor([float(own.rank)])
    own.broadcast(x, src=0)
    assert x.item() == 0.0, x

    own.shutdown()
    pair.shutdown()
    g2.shutdown()
    return {"g2_members": sorted(rank, key=rank.__getitem__)}


def _bits(group: ProcessGroup, bit: int) -> int:
    t = torch.tensor([1 << bit])
    group.all_reduce(t)
    return int(t.item())


def first_formation(store: TCPStore, me: str) -> dict[str, Any]:
    """P0-P3: the first g2; stays alive until told, while the latecomers form the next one."""
    g2 = rendezvous(store, "g2", 4, backends="tcp", timeout=OP_TIMEOUT_S)
    _emit("formed", rank=g2.rank, members=_bits(g2, int(me[1])))
    _command("again")
    members = _bits(g2, int(me[1]))
    g2.shutdown()
    return {"members_again": members}


def latecomer(store: TCPStore, me: str) -> dict[str, Any]:
    """Q0-Q3: arrive after g2 filled. Q0 first comes alone and times out; then all four form g2 again."""
    if me == "Q0":
        _command("alone")
        try:
            rendezvous(store, "g2", 4, backends="tcp", timeout=LONE_TIMEOUT_S)
        except CollectiveTimeout as exc:
            _emit("alone", error=type(exc).__name__, message=str(exc))
        else:
            raise AssertionError("a lone latecomer formed g2")
    _command("join")
    g2 = rendezvous(store, "g2", 4, backends="tcp", timeout=OP_TIMEOUT_S)
    _emit("formed", rank=g2.rank, members=_bits(g2, 4 + int(me[1])))
    g2.shutdown()
    return {}


ROLES = {"A": prefill, "B": prefill, "C": decode, "D": decode, "P": first_formation, "Q": latecomer}


def _child(role: str, port: str) -> int:
    faulthandler.enable(all_threads=True)  # the test's SIGABRT on failure: every thread's stack on stderr
    faulthandler.dump_traceback_later(CHILD_LIMIT_S, exit=True)
    torch.set_num_threads(1)
    try:
        store = TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=OP_TIMEOUT_S))
        before = resources()
        report = ROLES[role[0]](store, role)
        leak = leaks(before)  # after shutdown, nothing may remain (the pool's leak check)
        if leak is not None:
            raise AssertionError(f"after shutdown: {leak}")
        _emit("done", **report)
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        _emit("error", traceback=tb)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
