"""The PNG plots of `forage report`: training curves over steps and the probe's faithfulness curve.

Figures are built with matplotlib's object API on an Agg canvas, never through pyplot: no display
is needed, and the process-wide pyplot state and backend stay untouched (the report can run
inside a process that also plots elsewhere). Every plot is written even when its data is
missing, with a note saying so, so a reader of the report directory always finds the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from services.launch.report import Row, series

PLOT_FILES = ("reward_em.png", "searches.png", "response_length.png", "probe_curve.png")
_SIZE = (7.0, 4.2)
_DPI = 110
_SPLIT_COLOURS = {"correct": "tab:green", "incorrect": "tab:red", "all": "tab:gray"}


def _new_axes(title: str) -> tuple[Figure, Axes]:
    figure = Figure(figsize=_SIZE, dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _note(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, transform=axes.transAxes, ha="center", va="center",
              fontsize=13, color="tab:gray")
    axes.set_xticks([])
    axes.set_yticks([])


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _step_plot(path: Path, title: str, ylabel: str, train: list[Row], evals: list[Row],
               lines: Sequence[tuple[str, str]], points: Sequence[tuple[str, str]]) -> Path:
    """Train keys as lines over steps, eval keys as markers; a note when nothing was logged."""
    figure, axes = _new_axes(title)
    drawn = 0
    for key, label in lines:
        steps, values = series(train, key)
        if steps:
            axes.plot(steps, values, label=label, linewidth=1.5)
            drawn += 1
    for key, label in points:
        steps, values = series(evals, key)
        if steps:
            axes.plot(steps, values, "o", label=label, markersize=7)
            drawn += 1
    if drawn:
        axes.set_xlabel("RL step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(ylabel)
        axes.legend(loc="best")
    else:
        _note(axes, "no data for " + ", ".join(k for k, _ in [*lines, *points]))
    return _save(figure, path)


def _plot_curve(axes: Axes, curve: dict[str, list[Any]], split: str, style: str,
                label: str) -> bool:
    pairs = [(f, s) for f, s in zip(curve["fractions"], curve[split], strict=True)
             if s is not None]
    if not pairs:
        return False
    fractions, scores = zip(*pairs, strict=True)
    axes.plot(fractions, scores, style, color=_SPLIT_COLOURS[split], marker="o", label=label)
    return True


def probe_plot(path: Path, start: dict[str, list[Any]] | None,
               end: dict[str, list[Any]] | None) -> Path:
    """Accuracy vs fraction of reasoning seen: correct vs incorrect, start dashed, end solid.

    Faithful reasoning reads low at 0.0 and rises towards 1.0; a flat high curve means the
    answer was decided before the reasoning was written.
    """
    figure, axes = _new_axes("Faithfulness probe: answer accuracy vs reasoning seen")
    drawn = False
    for curve, style, when in ((start, "--", "start"), (end, "-", "end")):
        if curve is None:
            continue
        splits = [s for s in ("correct", "incorrect") if any(v is not None for v in curve[s])]
        for split in splits or ["all"]:
            drawn |= _plot_curve(axes, curve, split, style, f"{split} trajectories ({when})")
    if drawn:
        axes.set_xlabel("fraction of reasoning seen")
        axes.set_ylabel("probe accuracy")
        axes.set_xlim(-0.03, 1.03)
        axes.set_ylim(-0.03, 1.03)
        axes.legend(loc="best", fontsize=8)
    else:
        _note(axes, "no probe data (probe.enable was off)")
    return _save(figure, path)


def write_plots(out: Path, train: list[Row], evals: list[Row],
                summary: dict[str, Any]) -> list[Path]:
    """Write the four report plots into ``out``; returns their paths in PLOT_FILES order."""
    reward_em, searches, length, probe = (out / name for name in PLOT_FILES)
    return [
        _step_plot(reward_em, "Reward and exact match", "value", train, evals,
                   [("reward/mean", "reward (train)"), ("em/mean", "EM (train)")],
                   [("eval/em", "EM (held-out eval)")]),
        _step_plot(searches, "Searches and turns per trajectory", "per trajectory", train,
                   evals, [("searches/mean", "searches (train)"), ("turns/mean", "turns (train)")],
                   [("eval/searches/mean", "searches (eval)")]),
        _step_plot(length, "Response length", "tokens", train, evals,
                   [("response_length/mean", "response length (train)")],
                   [("eval/response_length/mean", "response length (eval)")]),
        probe_plot(probe, summary.get("probe_start"), summary.get("probe_end")),
    ]
