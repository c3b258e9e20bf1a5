"""The configuration that travels to the ranks (:class:`Config`, as JSON), and how the command
line's arguments become one: every check, the backends resolved and the baselines chosen, so a
wrong argument fails before any rank starts."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .catalog import ASYNC_OPS, BASELINE, BASELINES, KNOWN_OPS, MPI4PY, OPS, BenchError
from .sizing import csv_list, requested_sizes

if TYPE_CHECKING:
    from ..backend import BackendSpec
    from ..registry import PluginEntry

__all__ = ["Config", "choose_baselines", "config_from_args", "resolve_backends"]


@dataclasses.dataclass
class Config:
    """A run as the ranks get it (as JSON, in a file): what to measure, how, and where to
    report; made by :func:`config_from_args`, completed by the parent (``port``, ``results``,
    ``parent_pid``)."""

    world_size: int
    backends: list[str]  # registry names or module:attr
    labels: list[str]
    baselines: list[str]  # of BASELINES, measured in this order
    ops: list[str]
    sizes: list[int]
    dtype: str
    iters: int
    warmup: int
    time_budget: float
    timeout: float
    pin_ranks: bool = False
    to_torch: bool = False
    control: bool = False  # --control: each baseline timed a second time, as a row of its own
    rounds: int = 1
    port: int = 0
    results: str = ""
    parent_pid: int = 0
    #: how the ranks are started (BackendSpec.launcher of a backend measured, or the mpi4py baseline's)
    launcher: str | None = None

    def runners(self) -> int:
        """Rows per (op, size): each backend (and its ``to_torch`` face) and each baseline (and its control)."""
        return len(self.backends) * (2 if self.to_torch else 1) + len(self.baselines) * (2 if self.control else 1)


def config_from_args(args: argparse.Namespace) -> Config:
    """The run ``args`` (from :func:`pg_core.bench.cli.add_arguments`' parser) ask for, every
    argument checked and every backend resolved here; ``BenchError`` saying what to change."""
    n = args.world_size
    if n < 1:
        raise BenchError(f"--world-size must be >= 1, got {n}")
    if args.iters < 1:
        raise BenchError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {args.rounds}")
    if not args.time_budget > 0 or not args.timeout > 0:
        raise BenchError("--time-budget and --timeout must be positive")
    if args.pin_ranks and not hasattr(os, "sched_setaffinity"):
        raise BenchError("--pin-ranks needs os.sched_setaffinity, which this platform lacks (it is Linux's)")
    ops = list(OPS) if args.ops.strip() == "all" else list(dict.fromkeys(csv_list(args.ops)))
    unknown = [op for op in ops if op not in KNOWN_OPS]
    if unknown or not ops:
        raise BenchError(f"--ops: unknown {', '.join(unknown) or 'nothing named'}; known: {', '.join(KNOWN_OPS)}")
    if args.async_forms:
        ops = list(dict.fromkeys(o for op in ops for o in (op, ASYNC_OPS.get(op)) if o is not None))
    try:
        sizes = requested_sizes(args.sizes, args.min_bytes, args.max_bytes, args.factor)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    backends, labels, launchers = resolve_backends(args.backends)
    baselines = [] if args.no_baseline else choose_baselines(args.baseline, launchers)
    if MPI4PY in baselines:
        launchers.add("mpiexec")
    if len(launchers) > 1:
        raise BenchError(f"--backends: their ranks must be started by different launchers ({sorted(launchers)})")
    if not backends and not baselines:
        raise BenchError("nothing to measure: no pg-core backend named and no baseline")
    if args.control and not baselines:
        raise BenchError("--control times a baseline twice, and no baseline is measured (--no-baseline)")
    if len(set(labels)) != len(labels) or set(BASELINES) & set(labels) or any("/" in label for label in labels):
        raise BenchError(f"--backends: labels {labels} must be distinct, without '/', and none of {BASELINES}")
    return Config(
        world_size=n,
        backends=backends,
        labels=labels,
        baselines=baselines,
        ops=ops,
        sizes=sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        time_budget=args.time_budget,
        timeout=args.timeout,
        pin_ranks=args.pin_ranks,
        to_torch=args.to_torch,
        control=args.control,
        rounds=args.rounds,
        launcher=next(iter(launchers), None),
    )


def choose_baselines(text: str, launchers: set[str]) -> list[str]:
    """``--baseline`` as the baselines to measure, in order; ``launchers``: those the backends
    measured need (``auto`` adds mpi4py where mpiexec starts the ranks anyway)."""
    import torch.distributed as dist

    gloo = dist.is_available() and dist.is_gloo_available()
    mpi4py = importlib.util.find_spec("mpi4py") is not None
    if text.strip() == "auto":
        return [BASELINE] * gloo + [MPI4PY] * (mpi4py and "mpiexec" in launchers)
    chosen = list(dict.fromkeys(csv_list(text)))
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown or not chosen:
        raise BenchError(
            f"--baseline: unknown {', '.join(unknown) or 'nothing named'}; known: {', '.join(BASELINES)} "
            "(comma-separated), 'auto', or --no-baseline"
        )
    if BASELINE in chosen and not gloo:
        raise BenchError(f"this torch has no Gloo, so no {BASELINE} baseline; pass --no-baseline")
    if MPI4PY in chosen and not mpi4py:
        raise BenchError(f"--baseline {MPI4PY} needs mpi4py (pip install pg-mpi brings it); or pass --no-baseline")
    return chosen


def resolve_backends(text: str | None) -> tuple[list[str], list[str], set[str]]:
    """``--backends`` as references and the labels of their rows, resolved here (with
    :func:`pg_core.backend_refs.resolve_backend_ref`, as the ranks do), so a wrong one fails
    before any rank starts. A name's label is the name; a ``module:attr`` or
    ``file.py:attr`` one's, the name of the spec it resolves to. A backend whose spec declares
    a launcher is resolved where its ranks will run (``here=False``); the third value is the
    launchers the named backends declare."""
    from ..backend_refs import resolve_backend_ref
    from ..errors import PGError
    from ..registry import default_registry

    registry = default_registry()
    if text is None:
        specs = registry.available_for("cpu") + _launched_for("cpu", registry.entries())
        if not specs:
            try:
                registry.default_for("cpu")
            except PGError as exc:
                raise BenchError(f"{exc} Pass --backends '' to measure the {BASELINE} baseline alone.") from None
        specs.sort(key=lambda spec: (-spec.priority, spec.name))
        names = [spec.name for spec in specs]
        return names, list(names), {spec.launcher for spec in specs if spec.launcher is not None}
    refs = list(dict.fromkeys(csv_list(text)))
    labels = []
    launchers: set[str] = set()
    for ref in refs:
        try:
            spec = resolve_backend_ref(ref, "cpu", registry=registry, here=False)
        except PGError as exc:
            raise BenchError(f"--backends: {exc}") from None
        labels.append(spec.name if ":" in ref else ref)
        if spec.launcher is not None:
            launchers.add(spec.launcher)
    return refs, labels, launchers


def _launched_for(device: str, entries: Sequence[PluginEntry]) -> list[BackendSpec]:
    """The backends for ``device`` that are unavailable here only because a launcher must start
    their ranks, and that are available in a process it starts (asked there: a second or two
    each); those of the first such launcher, since one run's ranks are started one way."""
    from ..launchers import why_unavailable_launched

    found: list[BackendSpec] = []
    for entry in entries:
        spec = entry.spec
        if entry.status != "unavailable" or spec is None or spec.launcher is None or device not in spec.devices:
            continue
        if found and spec.launcher != found[0].launcher:
            continue
        if why_unavailable_launched(spec.name, spec.launcher) is None:
            found.append(spec)
    return found
