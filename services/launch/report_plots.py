"""The PNG plots of `forage report`: training curves, per-data-source panels, RL health, and the
probe's faithfulness curve at the start and end of RL and over training.

Figures are built with matplotlib's object API on an Agg canvas, never through pyplot: no display
is needed, and the process-wide pyplot state and backend stay untouched (the report can run
inside a process that also plots elsewhere). Every plot is written even when its data is
missing, with a note saying so, so a reader of the report directory always finds the same files.

Reading conventions (the ones TensorBoard and wandb users expect): per-step training values are
drawn faint, their exponential moving average bold (`smoothing`, TensorBoard's debiased EMA);
held-out evaluations are markers with 95% Wilson intervals and their n in the legend; every
title carries the run name and its key settings; the x axis is the RL step or, with
`x_axis="wall"`, wall-clock minutes since the learner started (`elapsed_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from services.launch.report import (
    Row,
    _number,
    data_sources,
    eval_ci,
    probe_matrix,
    smooth,
)

PLOT_FILES = ("reward_em.png", "searches.png", "response_length.png", "probe_curve.png",
              "per_source.png", "rl_health.png", "probe_heatmap.png", "retrieval.png")
# Retrieval health (services/common/retrieval_health.py): the rates panel and the latency panel.
RETRIEVAL_RATES = (("retrieval/gold_hit_rate", "gold in a passage (trajectories)"),
                   ("retrieval/empty_rate", "empty results (search turns)"),
                   ("retrieval/repeated_passage_rate", "repeated passages"),
                   ("retrieval/repeated_query_rate", "repeated queries"),
                   ("retrieval/cache_hit_rate", "cache hits"))
RETRIEVAL_LATENCY = (("retrieval/latency_p50_ms", "p50"), ("retrieval/latency_p99_ms", "p99"))
_SIZE = (7.0, 4.4)
_DPI = 110
_SPLIT_COLOURS = {"correct": "tab:green", "incorrect": "tab:red", "all": "tab:gray"}
_RAW_ALPHA = 0.25
# The RL-health panels: (title, [(key, label), ...], note when none was logged). The keys are
# the ones services/learner/loop.py writes (`actor/<trainer metric>`, batch_stats, timings).
HEALTH_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("KL", (("actor/ppo_kl", "PPO KL (old -> new)"), ("actor/approx_kl", "approx KL"),
            ("actor/kl_loss", "KL to reference (loss)")),
     "no KL logged"),
    ("entropy", (("actor/entropy", "token entropy"),),
     "not logged: actor/entropy needs\nlearner.algorithm.entropy_coeff != 0"),
    ("clip fractions", (("actor/pg_clipfrac", "clipped (ratio)"),
                        ("actor/clipfrac", "clipped (ratio)"),
                        ("actor/pg_clipfrac_lower", "dual-clip lower"),
                        ("actor/clipfrac_high", "ratio > 1 + eps_high"),
                        ("actor/clipfrac_low", "ratio < 1 - eps_low"),
                        ("actor/tis_clipfrac", "TIS weight capped"),
                        ("rollout_corr/rollout_is_ratio_fraction_high", "IS weight capped"),
                        ("critic/vf_clipfrac", "value clipped")),
     "no clip fractions logged"),
    ("grad norm", (("actor/grad_norm", "actor"), ("critic/grad_norm", "critic")),
     "no grad norm logged"),
    ("staleness (policy versions)", (("staleness/mean", "mean"), ("staleness/max", "max")),
     "no staleness logged"),
    ("throughput", (("throughput/trained_tokens_per_s", "trained tokens/s"),),
     "no throughput logged"),
)


def _x_values(rows: list[Row], key: str, x_axis: str) -> tuple[list[float], list[float]]:
    """(x, value) of the rows with a finite number for `key` (and for elapsed_s on wall)."""
    xs, values = [], []
    for row in rows:
        value = _number(row.get(key))
        x = _number(row.get("step") if x_axis == "step" else row.get("elapsed_s"))
        if value is None or x is None:
            continue
        xs.append(x if x_axis == "step" else x / 60.0)
        values.append(value)
    return xs, values


def _x_label(x_axis: str) -> str:
    return "RL step" if x_axis == "step" else "wall clock (minutes since the learner started)"


def _new_figure(size: tuple[float, float] = _SIZE) -> Figure:
    figure = Figure(figsize=size, dpi=_DPI)
    FigureCanvasAgg(figure)
    return figure


def _new_axes(title: str, run_title: str = "") -> tuple[Figure, Axes]:
    figure = _new_figure()
    axes = figure.add_subplot()
    _titled(axes, title, run_title)
    return figure, axes


def _titled(axes: Axes, title: str, run_title: str = "", size: float = 11) -> None:
    axes.set_title(f"{title}\n{run_title}" if run_title else title, fontsize=size)
    axes.grid(True, alpha=0.3)


def _note(axes: Axes, text: str, size: float = 13) -> None:
    axes.text(0.5, 0.5, text, transform=axes.transAxes, ha="center", va="center",
              fontsize=size, color="tab:gray")
    axes.set_xticks([])
    axes.set_yticks([])


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _train_line(axes: Axes, rows: list[Row], key: str, label: str, colour: str, x_axis: str,
                smoothing: float) -> bool:
    """The per-step values faint and their moving average bold; False when nothing logged."""
    xs, values = _x_values(rows, key, x_axis)
    if not xs:
        return False
    if smoothing > 0 and len(xs) > 1:
        axes.plot(xs, values, color=colour, alpha=_RAW_ALPHA, linewidth=1.0)
        axes.plot(xs, smooth(values, smoothing), color=colour, linewidth=2.2,
                  label=f"{label} (EMA {smoothing:g})")
    else:
        axes.plot(xs, values, color=colour, linewidth=1.8, marker="." if len(xs) < 3 else None,
                  label=label)
    return True


def _eval_markers(axes: Axes, rows: list[Row], key: str, label: str, colour: str, x_axis: str,
                  source: str | None = None, em: bool = False) -> bool:
    """Held-out values as markers; for EM, 95% Wilson error bars and n in the legend."""
    if not em:
        xs, values = _x_values(rows, key, x_axis)
        if xs:
            axes.plot(xs, values, "o", color=colour, markersize=7, label=label)
        return bool(xs)
    xs, centres, low, high, counts = [], [], [], [], set()
    for row in rows:
        found = eval_ci(row, source)
        point = _x_values([row], key, x_axis)
        if not point[0]:
            continue
        xs.append(point[0][0])
        centres.append(point[1][0])
        if found is None:
            low.append(0.0)
            high.append(0.0)
        else:
            low.append(point[1][0] - found[1])
            high.append(found[2] - point[1][0])
            counts.add(found[3])
    if not xs:
        return False
    n_text = f", n = {'/'.join(map(str, sorted(counts)))}, 95% CI" if counts else ""
    axes.errorbar(xs, centres, yerr=[low, high], fmt="o", color=colour, markersize=7,
                  capsize=4, elinewidth=1.5, label=f"{label}{n_text}")
    return True


def _finish(axes: Axes, drawn: bool, x_axis: str, ylabel: str, missing: str) -> None:
    if drawn:
        axes.set_xlabel(_x_label(x_axis))
        if x_axis == "step":
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(ylabel)
        axes.legend(loc="best", fontsize=8)
    else:
        _note(axes, missing)


def _step_plot(path: Path, title: str, ylabel: str, train: list[Row], evals: list[Row],
               lines: Sequence[tuple[str, str]], points: Sequence[tuple[str, str]], *,
               run_title: str = "", x_axis: str = "step", smoothing: float = 0.6,
               em_points: bool = False) -> Path:
    """Train keys as faint raw + bold smoothed lines, eval keys as markers (with CIs for EM)."""
    figure, axes = _new_axes(title, run_title)
    drawn = False
    colours = iter(f"C{i}" for i in range(10))
    for key, label in lines:
        drawn |= _train_line(axes, train, key, label, next(colours), x_axis, smoothing)
    for key, label in points:
        drawn |= _eval_markers(axes, evals, key, label, next(colours), x_axis, em=em_points)
    _finish(axes, drawn, x_axis, ylabel, "no data for " + ", ".join(
        k for k, _ in [*lines, *points]))
    return _save(figure, path)


def per_source_plot(path: Path, train: list[Row], evals: list[Row], run_title: str,
                    x_axis: str, smoothing: float) -> Path:
    """One panel per data source (e.g. single-hop vs multi-hop): train EM and reward, held-out
    EM with its interval, so a gain on one kind of question is not hidden by the average."""
    sources = data_sources(train, evals)
    if not sources:
        figure, axes = _new_axes("Per data source", run_title)
        _note(axes, "no per-data-source keys logged")
        return _save(figure, path)
    columns = min(3, len(sources))
    rows_n = -(-len(sources) // columns)
    figure = _new_figure((5.2 * columns, 3.9 * rows_n + 0.6))
    figure.suptitle(f"Per data source\n{run_title}", fontsize=11)
    for index, source in enumerate(sources):
        axes = figure.add_subplot(rows_n, columns, index + 1)
        _titled(axes, source, size=10)
        drawn = _train_line(axes, train, f"em/{source}", "EM (train)", "C0", x_axis, smoothing)
        drawn |= _train_line(axes, train, f"reward/{source}/mean", "reward (train)", "C1",
                             x_axis, smoothing)
        drawn |= _eval_markers(axes, evals, f"eval/em/{source}", "EM (held-out)", "C3",
                               x_axis, source=source, em=True)
        _finish(axes, drawn, x_axis, "value", f"nothing logged for {source}")
    return _save(figure, path)


def rl_health_plot(path: Path, train: list[Row], run_title: str, x_axis: str,
                   smoothing: float) -> Path:
    """KL, entropy, clip fractions, grad norm, staleness and throughput: the panels that show
    an RL run going wrong (policy drifting, collapsing, exploding or starving) before EM does."""
    figure = _new_figure((14.0, 7.6))
    figure.suptitle(f"RL health\n{run_title}", fontsize=11)
    for index, (title, keys, missing) in enumerate(HEALTH_PANELS):
        axes = figure.add_subplot(2, 3, index + 1)
        _titled(axes, title, size=10)
        drawn, seen = False, set()
        colours = iter(f"C{i}" for i in range(10))
        for key, label in keys:
            if label in seen and title == "clip fractions":
                continue  # pg_clipfrac and clipfrac are one metric under two names
            if _train_line(axes, train, key, f"{label} [{key}]", next(colours), x_axis,
                           smoothing):
                drawn = True
                seen.add(label)
        if title == "throughput" and drawn:
            twin = axes.twinx()
            xs, values = _x_values(train, "timing/step_s", x_axis)
            if xs:
                twin.plot(xs, values, color="C7", linewidth=1.2, linestyle=":",
                          label="step time (s) [timing/step_s]")
                twin.set_ylabel("seconds per step", fontsize=8)
                twin.legend(loc="lower right", fontsize=7)
        _finish(axes, drawn, x_axis, title, missing)
        if drawn:
            axes.legend(loc="best", fontsize=7)
    return _save(figure, path)


def retrieval_plot(path: Path, train: list[Row], evals: list[Row], run_title: str,
                   x_axis: str, smoothing: float) -> Path:
    """Retrieval health per step: how often a passage held the gold answer, empty results,
    repeats, cache hits (left) and the latency of the retrieval behind a search turn (right),
    so a retriever that silently returns nothing useful shows before the reward flattens."""
    figure = _new_figure((12.0, 4.6))
    figure.suptitle(f"Retrieval health\n{run_title}", fontsize=11)
    rates = figure.add_subplot(1, 2, 1)
    _titled(rates, "rates", size=10)
    drawn = False
    for index, (key, label) in enumerate(RETRIEVAL_RATES):
        drawn |= _train_line(rates, train, key, label, f"C{index}", x_axis, smoothing)
    drawn |= _eval_markers(rates, evals, "eval/retrieval/gold_hit_rate",
                           "gold in a passage (held-out)", "C0", x_axis)
    _finish(rates, drawn, x_axis, "fraction", "no retrieval health logged\n(no search results)")
    if drawn:
        rates.set_ylim(-0.03, 1.03)
    latency = figure.add_subplot(1, 2, 2)
    _titled(latency, "latency per search turn (ms)", size=10)
    drawn = False
    for index, (key, label) in enumerate(RETRIEVAL_LATENCY):
        drawn |= _train_line(latency, train, key, label, f"C{index + 5}", x_axis, smoothing)
    _finish(latency, drawn, x_axis, "ms", "no retrieval latency logged")
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
               end: dict[str, list[Any]] | None, run_title: str = "") -> Path:
    """Accuracy vs fraction of reasoning seen: correct vs incorrect, start dashed, end solid.

    Faithful reasoning reads low at 0.0 and rises towards 1.0; a flat high curve means the
    answer was decided before the reasoning was written.
    """
    figure, axes = _new_axes("Faithfulness probe: answer accuracy vs reasoning seen", run_title)
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


def probe_heatmap(path: Path, train: list[Row], run_title: str = "") -> Path:
    """The probe curve over training: accuracy by fraction of reasoning (rows) x step
    (columns), for all / correct / incorrect trajectories, with the number of probed
    trajectories behind each column printed above it."""
    matrices = [(split, probe_matrix(train, split)) for split in ("all", "correct", "incorrect")]
    matrices = [(split, m) for split, m in matrices if m is not None]
    if not matrices:
        figure, axes = _new_axes("Probe over training", run_title)
        _note(axes, "no probe data (probe.enable was off)")
        return _save(figure, path)
    figure = _new_figure((10.0, 2.6 * len(matrices) + 1.0))
    figure.suptitle(f"Probe accuracy by fraction of reasoning seen x step "
                    f"(n = trajectories probed)\n{run_title}", fontsize=11)
    image = None
    for index, (split, matrix) in enumerate(matrices):
        axes = figure.add_subplot(len(matrices), 1, index + 1)
        data = [[float("nan") if v is None else v for v in row] for row in matrix["accuracy"]]
        steps, fractions = matrix["steps"], matrix["fractions"]
        image = axes.imshow(data, aspect="auto", origin="lower", vmin=0.0, vmax=1.0,
                            cmap="viridis", interpolation="nearest")
        stride = max(1, -(-len(steps) // 20))
        ticks = list(range(0, len(steps), stride))
        axes.set_xticks(ticks, [f"{steps[i]:g}" for i in ticks], fontsize=7)
        axes.set_yticks(range(len(fractions)), [f"{f:.2f}" for f in fractions], fontsize=7)
        axes.set_ylabel(f"{split}\nfraction seen", fontsize=8)
        for column in ticks:
            count = matrix["n"][column]
            axes.text(column, len(fractions) - 0.45, "?" if count is None else str(count),
                      ha="center", va="bottom", fontsize=6, color="black")
        axes.set_ylim(-0.5, len(fractions) + 0.2)
        if index == len(matrices) - 1:
            axes.set_xlabel("RL step")
    if image is not None:
        figure.colorbar(image, ax=figure.axes, shrink=0.8, label="probe accuracy")
    figure.savefig(path, format="png")
    return path


def write_plots(out: Path, train: list[Row], evals: list[Row], summary: dict[str, Any], *,
                x_axis: str = "step", smoothing: float = 0.6) -> list[Path]:
    """Write the report plots into ``out``; returns their paths in PLOT_FILES order."""
    paths = [out / name for name in PLOT_FILES]
    title = summary.get("title") or ""
    common = {"run_title": title, "x_axis": x_axis, "smoothing": smoothing}
    return [
        _step_plot(paths[0], "Reward and exact match", "value", train, evals,
                   [("reward/mean", "reward (train)"), ("em/mean", "EM (train)")],
                   [("eval/em", f"EM (held-out, {summary.get('eval_mode') or 'greedy'})")], em_points=True, **common),
        _step_plot(paths[1], "Searches and turns per trajectory", "per trajectory", train,
                   evals, [("searches/mean", "searches (train)"), ("turns/mean", "turns (train)")],
                   [("eval/searches/mean", "searches (held-out)")], **common),
        _step_plot(paths[2], "Response length", "tokens", train, evals,
                   [("response_length/mean", "response length (train)")],
                   [("eval/response_length/mean", "response length (held-out)")], **common),
        probe_plot(paths[3], summary.get("probe_start"), summary.get("probe_end"), title),
        per_source_plot(paths[4], train, evals, title, x_axis, smoothing),
        rl_health_plot(paths[5], train, title, x_axis, smoothing),
        probe_heatmap(paths[6], train, title),
        retrieval_plot(paths[7], train, evals, title, x_axis, smoothing),
    ]
