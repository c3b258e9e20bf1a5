"""The parent that supervises the ranks: host the store, start the rank processes (or have a
launcher start them), follow rank 0's events, kill a rank that makes no progress after dumping
its stacks, and never leave one behind (:func:`run_ranks`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from ..launchers import launch_command
from ..procs import EXIT_UNKNOWN, LaunchedRanks, RankProcesses, tail
from ..progress import ProgressBar
from .config import Config
from .rank import WORKER_FLAG
from .report import Row
from .sizing import human_size

__all__ = ["Outcome", "run_ranks"]


@dataclasses.dataclass
class Outcome:
    """What a run left: the rows rank 0 reported, and why the run failed (``None``: it did not)."""

    rows: list[Row]
    failure: str | None


class _Results:
    """Rank 0's event file, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with self.path.open() as f:
                f.seek(self._offset)
                data = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        data = self._partial + data
        *lines, self._partial = data.split("\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)


def run_ranks(cfg: Config, progress: TextIO | None, *, bar: bool = False) -> Outcome:
    """Start the ranks, follow them to the end, stop them. ``progress``: where a line per row
    goes (``None``: nowhere); ``bar``: also keep a :class:`~pg_core.progress.ProgressBar` on it
    (only for a terminal: see :meth:`~pg_core.progress.ProgressBar.wanted`)."""
    from ..store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout))
    rows: list[Row] = []
    total = len(cfg.ops) * len(cfg.sizes) * cfg.runners()
    with tempfile.TemporaryDirectory(prefix="pg-core-bench-") as tmp:
        tmpdir = Path(tmp)
        cfg = dataclasses.replace(cfg, port=store.port, results=str(tmpdir / "results.jsonl"), parent_pid=os.getpid())
        config_path = tmpdir / "config.json"
        config_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # this very package's command line in worker mode; the folder holding pg_core goes last on
        # sys.path, so it shadows nothing
        src = str(Path(__file__).resolve().parents[2])
        boot = f"import sys; sys.path.append({src!r}); from pg_core.bench.cli import run; sys.exit(run())"
        commands = [[sys.executable, "-c", boot, WORKER_FLAG, str(r), str(config_path)] for r in range(cfg.world_size)]
        results = _Results(Path(cfg.results))
        ranks: RankProcesses | None = None
        shown = ProgressBar(progress, total) if bar and progress is not None else None
        try:
            if shown is not None:
                shown.update(current="starting the ranks, forming their groups")
            if cfg.launcher is not None:  # one launcher command starts them all (BackendSpec.launcher)
                argv = [sys.executable, "-c", boot, WORKER_FLAG, "-", str(config_path)]
                # the launcher's default: a rank that fails ends the job, and the launcher's status is its
                command = launch_command(cfg.launcher, cfg.world_size, argv)
                ranks = LaunchedRanks(command, cfg.world_size, env=env, log_dir=tmpdir)
            else:
                ranks = RankProcesses(commands, env=env, log_dir=tmpdir)
            failure = _supervise(
                cfg, ranks=ranks, results=results, rows=rows, total=total, progress=progress, bar=shown
            )
        finally:
            if shown is not None:
                shown.close()
            if ranks is not None:
                ranks.stop()
            del store
    return Outcome(rows, failure)


def _supervise(
    cfg: Config,
    *,
    ranks: RankProcesses,
    results: _Results,
    rows: list[Row],
    total: int,
    progress: TextIO | None,
    bar: ProgressBar | None = None,
) -> str | None:
    """Follow rank 0's events until every rank exits; return why the run failed, if it did."""
    t = cfg.timeout
    deadline = time.monotonic() + t + 120.0  # import torch, form every group
    waiting_for = "the ranks to start and form their groups"
    done = False
    planned = 0.0  # seconds the rows planned since the last row came should take (--rounds: all of them)
    while True:
        for event in results.read():
            kind = event.pop("event")
            now = time.monotonic()
            if kind == "start":
                deadline, waiting_for = now + 3 * t + 30.0, "the first measurement"
            elif kind == "plan":
                planned += event["runs"] * event["probe_ns"] / 1e9
                deadline = now + 3 * planned + 2 * t + 30.0
                waiting_for = f"{event['op']} {event['size']} B on {event['backend']}"
                if bar is not None:
                    bar.update(current=f"{event['op']} {human_size(event['size'])} on {event['backend']}")
            elif kind == "row":
                row = Row.from_dict(event)
                rows.append(row)
                planned = 0.0
                deadline, waiting_for = now + 3 * t + 30.0, "the next measurement"
                if progress is not None:
                    took = "" if row.median_us is None else f"median {row.median_us:.1f} us over {row.iters} iters, "
                    check = row.status if row.status != "skipped" else f"skipped ({row.detail})"
                    line = f"bench: [{len(rows)}/{total}] {row.op} {row.size} B {row.backend}: {took}{check}"
                    if bar is not None:
                        bar.done = len(rows)
                        bar.print(line)
                    else:
                        progress.write(line + "\n")
                        progress.flush()
            elif kind == "done":
                done, waiting_for = True, "the ranks to exit"
                if bar is not None:
                    bar.update(current="the ranks exit")
                deadline = now + t + 30.0
        codes = ranks.poll()
        if isinstance(ranks, LaunchedRanks):  # a rank gone before its launcher: exiting; the launcher says how
            codes = [None if c == EXIT_UNKNOWN else c for c in codes]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            running = [r for r, c in enumerate(codes) if c is None]
            stacks = ranks.dump_stacks(running)
            ranks.stop()
            parts = [
                f"rank {r} exited with status {codes[r]}; its output ends with:\n{_said(ranks.tail(r, lines=60))}"
                for r in failed
            ]
            parts += [f"rank {r} was still running (stopped); its stacks:\n{_said(stacks[r])}" for r in running]
            if isinstance(ranks, LaunchedRanks):
                parts.append(f"{cfg.launcher}'s own output ends with:\n{_said(tail(ranks.launcher_log, lines=40))}")
            return "\n\n".join(parts)
        if all(c == 0 for c in codes):
            for event in results.read():  # anything written just before exit
                if event.get("event") == "row":
                    event.pop("event")
                    rows.append(Row.from_dict(event))
                elif event.get("event") == "done":
                    done = True
            return None if done else "the ranks exited before finishing the sweep:\n" + _said(ranks.tail(0, lines=60))
        if time.monotonic() > deadline:
            stacks = ranks.dump_stacks()
            ranks.stop()
            dumps = "\n\n".join(f"rank {r}:\n{_said(stacks[r] or ranks.tail(r, lines=40))}" for r in range(len(ranks)))
            return f"no progress while waiting for {waiting_for}; stopped every rank. Their stacks:\n{dumps}"
        if bar is not None:
            bar.tick()
        time.sleep(0.05)


def _said(text: str) -> str:
    return text.rstrip() or "(no output)"
