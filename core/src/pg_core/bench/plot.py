"""``--plot``: median time and bus bandwidth against size, log-log, a panel pair per op, with
matplotlib (imported only here, and only when a plot is asked for)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any, Final

from .catalog import BASELINE_OF, BenchError
from .report import Row
from .sizing import human_size

__all__ = ["plot_colours", "plot_figure", "require_matplotlib", "write_plot"]


def require_matplotlib() -> None:
    """Raise ``BenchError`` saying what to install where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install matplotlib")


_MARKERS: Final[str] = "os^Dv<>px*"


def plot_colours(rows: Sequence[Row]) -> dict[str, str]:
    """Each backend's colour in :func:`write_plot` (matplotlib's ``C0``, ``C1``, ...): the pg-core
    backends in the order measured, then each baseline in the colour of the backend that wraps
    its library (:data:`~pg_core.bench.catalog.BASELINE_OF`) where that one was measured, else in one of its own."""
    colours: dict[str, str] = {}
    for backend in dict.fromkeys(r.backend for r in rows if not r.baseline):
        colours[backend] = f"C{len(colours) % 10}"
    for backend in dict.fromkeys(r.backend for r in rows if r.baseline):
        own = colours.get(BASELINE_OF.get(backend, ""))
        colours[backend] = own if own is not None else f"C{len(set(colours.values())) % 10}"
    return colours


def plot_figure(rows: Sequence[Row]) -> Any:
    """The figure :func:`write_plot` saves (a ``matplotlib.figure.Figure``): a row of panels
    per op, its own axes never shared with another op: median time per iteration (µs, or
    ms / s where the times are that long) and, where the op has one, bus bandwidth (GB/s),
    against the message size per rank in bytes (ticks as ``4 B``, ``64 KiB``, ``1 MiB``),
    log-log; one line per backend (a marker each), baselines dashed in their backend's colour
    (:func:`plot_colours`); one legend for the figure, below the panels, off the data.
    Needs matplotlib (``BenchError`` without it)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    timed = [r for r in rows if r.median_us]
    if not timed:
        raise BenchError("--plot: no row has a time to plot")
    ops = list(dict.fromkeys(r.op for r in timed))
    colours = plot_colours(timed)
    backends = list(dict.fromkeys(r.backend for r in timed))
    markers = {b: _MARKERS[i % len(_MARKERS)] for i, b in enumerate(backends)}
    fig = Figure(figsize=(12, 3.6 * len(ops) + 1.4), layout="constrained")
    panels = fig.subplots(len(ops), 2, squeeze=False, sharex="row")
    handles: dict[str, Any] = {}
    for (latency, bandwidth), op in zip(panels, ops, strict=True):
        mine = [r for r in timed if r.op == op]
        unit, scale = _time_unit(max(r.median_us or 0.0 for r in mine))
        for backend in dict.fromkeys(r.backend for r in mine):
            points = sorted((r for r in mine if r.backend == backend), key=lambda r: r.size)
            style = {
                "color": colours[backend],
                "linestyle": "--" if points[0].baseline else "-",
                "marker": markers[backend],
                "markersize": 4,
                "label": backend,
            }
            (line,) = latency.plot([r.size for r in points], [(r.median_us or 0.0) / scale for r in points], **style)
            handles.setdefault(backend, line)
            bw = [(r.size, r.busbw_gbps) for r in points if r.busbw_gbps]
            if bw:
                bandwidth.plot(*zip(*bw, strict=True), **style)
        sizes = sorted({r.size for r in mine})
        latency.set_title(f"{op}: median time (lower is better)")
        latency.set_ylabel(f"median time per iteration ({unit})")
        bandwidth.set_title(f"{op}: bus bandwidth (higher is better)")
        bandwidth.set_ylabel("bus bandwidth (GB/s)")
        for ax in (latency, bandwidth):
            _size_axis(ax, sizes)
        if not bandwidth.get_lines():
            bandwidth.text(0.5, 0.5, f"no bandwidth for {op}", ha="center", va="center", transform=bandwidth.transAxes)
            bandwidth.set_yticks([])
            bandwidth.set_ylabel("")
    first = timed[0]
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in timed))
    fig.suptitle(f"pg-core bench: world size {first.world_size}, {dtypes}")
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncols=min(len(handles), 6),
        title="backend (dashed: a raw library measured as the baseline)",
        fontsize="small",
    )
    return fig


def _time_unit(longest_us: float) -> tuple[str, float]:
    """The unit an axis of times up to ``longest_us`` microseconds reads best in, and its
    size in microseconds."""
    if longest_us >= 1e7:
        return "s", 1e6
    if longest_us >= 1e4:
        return "ms", 1e3
    return "µs", 1.0


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """Log-log axes against the message size: at most 8 size ticks, at the measured sizes
    where they are that few, else at every k-th power of two between them; plain numbers on
    the other axis (1, 2, 5, 10, 20, ... over up to three decades of data, else 0.01, 0.1, 1,
    ...), not powers of ten written as such. Call it once the data is drawn."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if len(sizes) <= 8:
        ticks = list(sizes)
    else:
        low, high = max(sizes[0], 1).bit_length() - 1, max(sizes[-1], 1).bit_length()
        step = max(1, math.ceil((high - low) / 8))
        ticks = [1 << k for k in range(low, high + 1, step)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_size(round(x))))
    ax.xaxis.set_minor_locator(NullLocator())
    low_y, high_y = ax.dataLim.y0, ax.dataLim.y1
    few_decades = low_y > 0 and high_y / low_y <= 1000  # 1, 2, 5 per decade; over more, powers of ten
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if few_decades else (1.0,), numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("message size per rank (bytes)")
    ax.grid(True, which="major", alpha=0.3)


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Save :func:`plot_figure` of ``rows`` as ``path`` (PNG, or what its suffix names)."""
    plot_figure(rows).savefig(path, dpi=120)
