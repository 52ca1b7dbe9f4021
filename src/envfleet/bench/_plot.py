"""The plot of ``envfleet bench --plot``: steps/s against num_envs, one line per system, one
panel per env id, the machine's limit as a reference line (see :mod:`envfleet.bench`).

matplotlib is optional (``pip install 'envfleet[plot]'``) and imported only here, only when a
plot is drawn; the figure is drawn on its own canvas, never through pyplot, so that nothing
global (a backend, an open window) changes in the caller's process.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from typing import Any

from envfleet import ConfigError
from envfleet.bench._sweep import BenchReport, Machine

__all__ = [
    "PLOT_DPI",
    "PLOT_INSTALL",
    "PLOT_LEGEND_INCHES",
    "PLOT_PANEL_INCHES",
    "machine_line",
    "plot_report",
    "require_matplotlib",
]

#: What to install for ``--plot``.
PLOT_INSTALL = "pip install 'envfleet[plot]'"
#: Size of one env id's panel in inches (width, height); the figure is one panel per env id
#: side by side, plus the legend's column on the right.
PLOT_PANEL_INCHES = (5.5, 4.6)
#: Width of the legend's column in inches.
PLOT_LEGEND_INCHES = 2.2
#: Pixels per inch of the PNG.
PLOT_DPI = 120

# envfleet's systems solid and bold, the peers thinner and dashed; one colour per system.
_STYLES: dict[str, dict[str, Any]] = {
    "processes": {"color": "tab:red", "marker": "o", "linewidth": 2.6},
    "serial": {"color": "tab:orange", "marker": "o", "linewidth": 2.0},
    "threads": {"color": "tab:brown", "marker": "o", "linewidth": 2.0},
    "ray": {"color": "tab:pink", "marker": "o", "linewidth": 2.0},
    "envpool": {"color": "tab:olive", "marker": "o", "linewidth": 2.0},
    "gym-sync": {"color": "tab:blue", "marker": "s", "linestyle": "--"},
    "gym-async": {"color": "tab:cyan", "marker": "s", "linestyle": "--"},
    "sb3-subproc": {"color": "tab:green", "marker": "^", "linestyle": "--"},
    "envpool-native": {"color": "tab:purple", "marker": "D", "linestyle": "--"},
    "puffer-mp": {"color": "tab:gray", "marker": "v", "linestyle": "--"},
}


def require_matplotlib() -> None:
    """Raise :class:`~envfleet.ConfigError` (saying what to install) when matplotlib is
    missing; call it before measuring, so that a missing plotter costs nothing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"--plot needs matplotlib: {PLOT_INSTALL}")


def plot_report(report: BenchReport, path: str, *, title: str | None = None) -> tuple[int, int]:
    """Draw a :class:`BenchReport` into an image file (PNG, or any format matplotlib knows
    from the file's extension).

    One panel per env id: env steps/s (log scale) against num_envs (log 2 scale, ticked at
    the values measured), one line per system, and the env's limit (:class:`LimitResult`) as
    a dotted black line. The figure's title names the machine (cores, CPU model) and the
    versions of Python, envfleet, gymnasium and the peers' libraries.

    Args:
        report: what :func:`envfleet.bench.run_bench` returned.
        path: the file to write (overwritten).
        title: the first line of the title (default: what was measured and how long).

    Returns:
        The image's size in pixels, ``(width, height)``: ``PLOT_DPI`` times
        (``PLOT_PANEL_INCHES[0]`` per env id plus ``PLOT_LEGEND_INCHES``,
        ``PLOT_PANEL_INCHES[1]``), rounded.

    Raises:
        ConfigError: matplotlib is missing (the message says what to install), or the report
            has no result.
        OSError: the file cannot be written.

    Example::

        report = run_bench(["CartPole-v1"], [4, 16], ["processes", "gym-async"], 1.0)
        plot_report(report, "bench.png")  # (900, 552)
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    env_ids = list(dict.fromkeys([*(lim.env_id for lim in report.limits)]))
    env_ids += [e for e in dict.fromkeys(r.env_id for r in report.results) if e not in env_ids]
    if not report.results:
        raise ConfigError("nothing to plot: the report has no result")
    systems = list(dict.fromkeys(r.system for r in report.results))
    width_in = PLOT_PANEL_INCHES[0] * len(env_ids) + PLOT_LEGEND_INCHES
    height_in = PLOT_PANEL_INCHES[1]
    fig = Figure(figsize=(width_in, height_in), dpi=PLOT_DPI, layout="constrained")
    axes = fig.subplots(1, len(env_ids), squeeze=False)[0]
    limits = {lim.env_id: lim for lim in report.limits}
    handles: dict[str, Any] = {}
    for ax, env_id in zip(axes, env_ids, strict=True):
        rows = [r for r in report.results if r.env_id == env_id]
        sizes = sorted({r.num_envs for r in rows})
        for system in systems:
            points = sorted((r.num_envs, r.steps_per_s) for r in rows if r.system == system)
            if not points:
                continue
            style = {"markersize": 5, "linewidth": 1.5, **_STYLES.get(system, {"marker": "x"})}
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], **style)
            handles.setdefault(system, line)
        limit = limits.get(env_id)
        if limit is not None:
            line = ax.axhline(limit.steps_per_s, color="black", linestyle=":", linewidth=1.8)
            handles.setdefault("limit", line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(NullLocator())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [str(n) for n in sizes])
        if len(sizes) == 1:
            ax.set_xlim(sizes[0] / 1.6, sizes[0] * 1.6)
        else:
            ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
        ax.yaxis.set_major_formatter(FuncFormatter(_si))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(env_id, fontsize=11)
        ax.set_xlabel("num_envs")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.1)
    axes[0].set_ylabel("env steps/s (summed over sub-envs)")
    labels = [s for s in systems if s in handles]
    if "limit" in handles:
        labels.append("limit")
    names = {
        "limit": f"limit: {report.machine.cores} cores ×\none plain env loop",
    }
    fig.legend(
        [handles[s] for s in labels],
        [names.get(s, s) for s in labels],
        loc="outside right center",
        fontsize=9,
        frameon=False,
    )
    fig.suptitle(title or _title(report, int(width_in * 11)), fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)
    return round(width_in * PLOT_DPI), round(height_in * PLOT_DPI)


def _title(report: BenchReport, width: int) -> str:
    what = (
        f"envfleet bench: env steps/s with random actions (higher is better); "
        f"{report.seconds:g} s per system"
    )
    if report.repeats > 1:
        what += f", median of {report.repeats}"
    return what + "\n" + machine_line(report.machine, min(width, 120))  # characters a line


def machine_line(machine: Machine, width: int = 120) -> str:
    """One or two lines naming the machine and the versions, for titles and captions."""
    versions = ", ".join(f"{name} {v}" for name, v in machine.versions.items())
    text = (
        f"{machine.cores} usable cores, {machine.cpu_model} ({machine.system}); "
        f"Python {machine.python}, {versions}"
    )
    return "\n".join(textwrap.wrap(text, width))


def _si(value: float, _pos: Any = None) -> str:
    """Tick label: 2k, 50k, 1.2M."""
    if not math.isfinite(value) or value <= 0:
        return ""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"
