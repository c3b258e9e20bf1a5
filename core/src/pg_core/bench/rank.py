"""What one rank process does (:class:`Rank`): form a group per runner, then for every row warm
up, plan, time and check it, and report to rank 0, which writes the rows for the parent;
:func:`worker_main`, a rank process's entry point."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TextIO

import torch

from ..procs import adopt_launched_rank, prepare_rank
from .baselines import Mpi4pyRunner, TorchGlooRunner
from .cases import Case, make_case, timed
from .catalog import DTYPES, ECHO_OPS, MPI4PY, OBJECT_OPS
from .config import Config
from .inputs import check_object, check_output, object_size
from .report import Row
from .runners import PgCoreRunner, Runner, ToTorchRunner
from .sizing import busbw_factor, element_count, plan_iterations, rotated, sweep_batches

__all__ = ["WORKER_FLAG", "Rank", "worker_main"]

#: The first argument of a rank process's command (``python -m pg_core.bench __worker__ RANK CONFIG``).
WORKER_FLAG: Final[str] = "__worker__"


@dataclasses.dataclass
class _Slot:
    """One runner's row of one (op, size) between its warmup and its report."""

    index: int
    runner: Runner
    row: Row
    case: Case | None  # None on a rank that takes no part
    times: list[int] = dataclasses.field(default_factory=list)  # this rank's, ns


class Rank:
    """What one rank process does: form the groups, run every row, report to rank 0 via the store."""

    def __init__(self, cfg: Config, rank: int) -> None:
        from ..store import PrefixStore, TCPStore

        self.cfg, self.rank = cfg, rank
        self.dtype = DTYPES[cfg.dtype]
        store = TCPStore("127.0.0.1", cfg.port, is_master=False, timeout=timedelta(seconds=cfg.timeout))
        self.store = store
        self.ctl = PrefixStore("pg-core-bench", store)
        self.runners: list[Runner] = []
        objects = any(op in OBJECT_OPS for op in cfg.ops)
        for control in (False, True) if cfg.control else (False,):
            for baseline in cfg.baselines:
                if baseline == MPI4PY:
                    self.runners.append(Mpi4pyRunner(control=control))
                else:
                    self.runners.append(
                        TorchGlooRunner(store, rank, cfg.world_size, cfg.timeout, objects=objects, control=control)
                    )
        for spec, label in zip(cfg.backends, cfg.labels, strict=True):
            runner = PgCoreRunner(store, rank, cfg.world_size, spec=spec, label=label, timeout=cfg.timeout)
            self.runners.append(runner)
            if cfg.to_torch:
                self.runners.append(ToTorchRunner(runner))
        self.results: TextIO | None = open(cfg.results, "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def emit(self, event: str, **fields: Any) -> None:
        if self.results is not None:
            self.results.write(json.dumps({"event": event, **fields}) + "\n")

    def run(self) -> None:
        cfg = self.cfg
        self.emit("start")
        index = 0
        for items in sweep_batches(cfg.ops, cfg.sizes):
            # one (op, size, runner) after the other; with --rounds R > 1, the iterations of every
            # runner and every op of the batch (an op and its asynchronous form) interleaved
            rows = [(op, requested, runner) for op, requested in items for runner in self.runners]
            batches = [[row] for row in rows] if cfg.rounds == 1 else [rows]
            for batch in batches:
                slots: list[_Slot] = []
                for op, requested, runner in batch:
                    count = element_count(op, requested, cfg.world_size, self.dtype.itemsize)
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

    def _sync(self, runner: Runner, key: str) -> None:
        """Line the ranks up: the runner's own barrier, or one on the store if it declares none."""
        if runner.barrier():
            return
        if int(self.ctl.add(f"sync/{key}", 1)) == self.cfg.world_size:
            self.ctl.set(f"sync/{key}/go", "1")
        self.ctl.wait([f"sync/{key}/go"], timedelta(seconds=self.cfg.timeout))

    def _base_row(self, op: str, requested: int, count: int, runner: Runner) -> Row:
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

    def _ready(self, index: int, op: str, requested: int, count: int, runner: Runner) -> _Slot | Row | None:
        """Row ``index`` warmed up and planned (a :class:`_Slot`); or, where the runner cannot
        run it, its skipped row on rank 0 (``None`` elsewhere)."""
        cfg, rank, n = self.cfg, self.rank, self.cfg.world_size
        row = self._base_row(op, requested, count, runner)
        reason = "needs world size >= 2" if op in ECHO_OPS and n < 2 else runner.why_not(op, self.dtype)
        if reason is not None:  # the same on every rank: nobody runs it
            row.detail = reason
            return row if rank == 0 else None
        case = make_case(op, runner, rank=rank, n=n, count=count, dtype=self.dtype)
        self._sync(runner, f"{index}/start")
        first = max(1, min(cfg.warmup, 3))
        probes = []
        for _ in range(first):
            if case is not None:
                case.refill()
                probes.append(timed(case.run))
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
            slot.times.append(timed(case.run))

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
        for q in range(2 if op in ECHO_OPS else n):
            key = f"result/{index}/{q}"
            got = json.loads(self.ctl.get(key))
            self.ctl.delete_key(key)
            per_rank.append(got["ns"])
            if got["error"]:
                errors.append(got["error"])
        if op in ECHO_OPS:  # rank 0's round trips, halved
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


def worker_main(argv: Sequence[str]) -> int:
    """A rank process: ``argv`` is ``[RANK, CONFIG]`` (``RANK`` ``-`` where a launcher started
    it and says which); pin it if asked, prepare it, run every row. Returns the exit status."""
    config_path = argv[1]
    cfg = Config(**json.loads(Path(config_path).read_text()))
    # "-": a launcher started the ranks; the rank is the launcher's, the log and pid go next to the config
    rank = adopt_launched_rank(Path(config_path).parent) if argv[0] == "-" else int(argv[0])
    if cfg.pin_ranks:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    # one intra-op thread, stacks on SIGUSR1, dies with the parent (a launched rank's parent is the
    # launcher's helper: stopping the launcher's session ends it instead)
    prepare_rank(parent_pid=None if cfg.launcher else cfg.parent_pid)
    worker = Rank(cfg, rank)
    try:
        worker.run()
    finally:
        worker.close()
    return 0
