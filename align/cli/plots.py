"""Pictures of runs' curves from their ``metrics.csv``: the ``align plot`` command and the ``curves.png`` every
``fit`` writes into its run folder.

Panels are chosen from the columns the CSV holds (:data:`PANELS`): reward, KL, loss, accuracy and margin (and the
episode panels of classic RL and multi-turn runs, a distillation's distance to its teacher, and a vLLM engine's
distance to the trainer, and an asynchronous source's staleness and waiting), each
drawing a training series next to its held-out (``val/...``) counterpart, so a gap between the two shows. A panel
none of whose columns was logged is left out. Training series are drawn raw (faint) and smoothed by an exponential
moving average; held-out series, logged a few times per run, are drawn as points. Several runs share the axes,
one colour per run.

matplotlib draws on its Agg canvas (no display) and pyplot is not used, so nothing global changes.
"""

from __future__ import annotations

import csv
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.errors import AlignError

METRICS = "metrics.csv"
CURVES = "curves.png"
HELD_OUT = "val/"
VERSION_DIR = re.compile(r"^version_(\d+)$")
NOT_METRICS = ("step", "epoch")
SMOOTH_FROM = 8  # points; shorter series are drawn raw only
SMOOTH_SHARE = 30  # the moving average spans 1/30 of a series' points (at least 3)
PANEL_WIDTH, PANEL_HEIGHT, TOP = 6.0, 3.4, 0.75  # inches; TOP holds the run's name or the runs' legend


class PlotError(AlignError):
    """A run folder without metrics, an empty ``metrics.csv`` or an unknown metric name."""


@dataclass(frozen=True)
class Panel:
    """One set of axes: the columns it draws, in order, when the CSV holds them."""

    title: str
    columns: tuple[str, ...]


# The training columns of each quantity that the modules log, then the held-out ones (drawn as points).
PANELS = (
    Panel("reward", ("rollout/reward_mean", "val/reward_mean")),
    Panel("episode return", ("rollout/episode_reward", "val/episode_reward")),
    Panel("exploration", ("rollout/epsilon",)),
    Panel("episodes", ("rollout/turns", "rollout/tool_calls", "rollout/tool_errors", "val/turns")),
    Panel("KL to the reference", ("train/kl", "val/kl")),
    Panel("distance to the teacher", ("distill/reverse_kl", "distill/jsd")),
    Panel("engine vs trainer", ("rollout/engine_kl", "rollout/engine_logprob_diff")),
    Panel("staleness", ("rollout/staleness", "rollout/policy_version_lag")),
    Panel("waiting (s)", ("time/trainer_idle_s", "time/generator_idle_s")),
    Panel("loss", ("train/loss", "val/loss")),
    Panel(
        "accuracy",
        (
            "dpo/accuracy",
            "online_dpo/accuracy",
            "rm/accuracy",
            "kto/accuracy",
            "val/accuracy",
            "val/teacher_accuracy",
            "val/dpo_accuracy",
            "val/rm_accuracy",
            "val/kto_accuracy",
        ),
    ),
    Panel(
        "margin",
        (
            "dpo/margin",
            "online_dpo/margin",
            "rm/margin",
            "kto/margin",
            "val/dpo_margin",
            "val/rm_margin",
            "val/kto_margin",
        ),
    ),
)


@dataclass(frozen=True)
class RunSeries:
    """One run's logged series, as its ``metrics.csv`` holds them: column -> (steps, values), both ascending by step,
    finite values only; ``label`` names the run in the picture. (The run folder with a checkpoint to continue from
    is :class:`align.cli.runs.Run`.)"""

    label: str
    directory: Path
    series: dict[str, tuple[list[float], list[float]]]


@dataclass(frozen=True)
class Curves:
    """What :func:`plot_runs` wrote: the picture and, per panel, its title and the columns drawn on it."""

    path: Path
    panels: tuple[tuple[str, tuple[str, ...]], ...]
    runs: tuple[str, ...]


def plot_runs(
    run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike, metrics: Sequence[str] | None = None
) -> Curves:
    """Draw the curves of ``run_dirs`` (run folders holding ``metrics.csv``, or roots holding ``version_N``
    folders) into the PNG ``output``. ``metrics`` names columns to draw, one panel each, instead of the default
    panels. Raises :class:`PlotError` with a one-line message for a folder without metrics, an empty CSV or an
    unknown metric."""
    directories = find_runs(run_dirs)
    runs = [read_run(d, label) for d, label in zip(directories, _labels(directories))]
    drawn = _draw(runs, choose_panels(runs, metrics), Path(output))
    return Curves(Path(output), drawn, tuple(r.label for r in runs))


def find_runs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Run folders: each path that holds ``metrics.csv`` (or is one), else the ``version_N`` folders under it
    that do, in version order."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_file() and path.suffix == ".csv":
            found.append(path.parent)
        elif (path / METRICS).is_file():
            found.append(path)
        elif inner := _version_dirs(path):
            found.extend(inner)
        else:
            raise PlotError(
                f"{path}: no {METRICS} here; expected a run folder (<root>/version_N holding "
                f"{METRICS}) or a root holding such folders"
            )
    return found


def read_run(directory: Path, label: str | None = None) -> RunSeries:
    """The series of ``directory/metrics.csv``. Lightning writes training and validation rows interleaved, each
    leaving the other's columns empty; empty and non-finite cells are skipped. A step logged twice (a resumed run
    repeats the steps after its last checkpoint) keeps its last value."""
    path = directory / METRICS
    by_column: dict[str, dict[float, float]] = {}
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = _number(row.get("step"))
                if step is None:
                    continue
                for column, cell in row.items():
                    value = _number(cell)
                    if column not in NOT_METRICS and column is not None and value is not None:
                        by_column.setdefault(column, {})[step] = value
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise PlotError(f"{path}: cannot be read as a CSV file ({type(err).__name__}: {err})") from None
    if not by_column:
        raise PlotError(f"{path}: no metrics logged (the file is empty or holds a header only)")
    series = {c: (sorted(v), [v[s] for s in sorted(v)]) for c, v in sorted(by_column.items())}
    return RunSeries(label or directory.name, directory, series)


def choose_panels(runs: Sequence[RunSeries], metrics: Sequence[str] | None = None) -> list[Panel]:
    """The default :data:`PANELS` cut down to the columns some run logged (empty panels left out), or one panel
    per name in ``metrics``. Without any default column, the first six logged columns get a panel each."""
    logged = sorted({c for r in runs for c in r.series})
    if metrics:
        unknown = [m for m in metrics if m not in logged]
        if unknown:
            raise PlotError(
                f"--metrics: {', '.join(unknown)} not logged by {_runs_named(runs)}; available: {', '.join(logged)}"
            )
        return [Panel(m, (m,)) for m in dict.fromkeys(metrics)]
    panels = [Panel(p.title, tuple(c for c in p.columns if c in logged)) for p in PANELS]
    panels = [p for p in panels if p.columns]
    return panels or [Panel(c, (c,)) for c in logged[:6]]


def smooth(values: Sequence[float]) -> list[float]:
    """Exponential moving average spanning 1/30 of the points (at least 3), debiased at the start as
    TensorBoard's is, so the first points are not pulled towards zero."""
    span = max(3.0, len(values) / SMOOTH_SHARE)
    weight = 1.0 - 2.0 / (span + 1.0)
    out, average, norm = [], 0.0, 0.0
    for v in values:
        average = weight * average + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(average / norm)
    return out


def _version_dirs(root: Path) -> list[Path]:
    """``root/version_N`` folders holding metrics, by N (as :func:`align.cli.runs.versions`, without importing
    Lightning: ``align plot`` starts in a fraction of a second)."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := VERSION_DIR.match(p.name)) and (p / METRICS).is_file()
    ]
    return [p for _, p in sorted(found)]


def _number(cell: str | None) -> float | None:
    if cell is None:
        return None
    try:
        value = float(cell)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _labels(directories: list[Path]) -> list[str]:
    """Short names for the legend: ``<root name>/version_N``, with more of the path where two would clash."""
    for depth in range(2, 1 + max((len(d.resolve().parts) for d in directories), default=2)):
        labels = ["/".join(d.resolve().parts[-depth:]) for d in directories]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in directories]


def _runs_named(runs: Sequence[RunSeries]) -> str:
    return ", ".join(str(r.directory / METRICS) for r in runs)


def _draw(runs: Sequence[RunSeries], panels: Sequence[Panel], output: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Write the figure to ``output`` (through a temporary file, so a reader never sees half a picture) and
    return each panel's title with the columns drawn on it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(PANEL_WIDTH * columns, TOP + PANEL_HEIGHT * rows), dpi=100)
    FigureCanvasAgg(figure)
    _fixed_margins(figure, columns, rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    drawn = tuple((panel.title, _draw_panel(ax, runs, panel)) for ax, panel in zip(axes, panels))
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    top = 1.0 - 0.1 / figure.get_figheight()
    if len(runs) == 1:
        figure.suptitle(runs[0].label, fontsize="large", y=top, va="top")
    else:
        handles = [Line2D([], [], color=_colour(i), lw=2) for i in range(len(runs))]
        figure.legend(
            handles,
            [r.label for r in runs],
            loc="upper center",
            bbox_to_anchor=(0.5, top),
            ncols=min(len(runs), 4),
            frameon=False,
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    figure.savefig(partial, format="png")
    os.replace(partial, output)
    return drawn


def _fixed_margins(figure, columns: int, rows: int) -> None:
    """Margins in inches, so a figure of any number of panels keeps room for tick labels, titles and the header.
    Fixed margins rather than a layout engine: those draw the figure again to measure it, doubling the cost."""
    width, height = figure.get_figwidth(), figure.get_figheight()
    left, right, bottom, gap_x, gap_y = 0.8, 0.25, 0.5, 0.85, 0.85
    panel_w = (width - left - right - gap_x * (columns - 1)) / columns
    panel_h = (height - TOP - bottom - gap_y * (rows - 1)) / rows
    figure.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - TOP / height,
        wspace=gap_x / panel_w,
        hspace=gap_y / panel_h,
    )


def _draw_panel(ax, runs: Sequence[RunSeries], panel: Panel) -> tuple[str, ...]:
    """One panel: per run and column, a training series as a faint raw line under its moving average, a held-out
    one as points joined by a dashed line. One run: a colour per column; several: a colour per run and the
    columns told apart by line style in the legend. Returns the columns drawn (for at least one run)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    several, drawn = len(runs) > 1, []
    training = [c for c in panel.columns if not c.startswith(HELD_OUT)]
    style = {c: TRAINING_STYLES[k % len(TRAINING_STYLES)] if several else "-" for k, c in enumerate(training)}
    for i, run in enumerate(runs):
        for j, column in enumerate(panel.columns):
            if column not in run.series:
                continue
            steps, values = run.series[column]
            drawn.append(column)
            colour = _colour(i if several else j)
            label = None if several else column
            if column.startswith(HELD_OUT):
                ax.plot(steps, values, color=colour, ls="--", marker="o", ms=4, lw=1.2, label=label)
            elif len(values) >= SMOOTH_FROM:
                ax.plot(steps, values, color=colour, lw=1.0, alpha=0.3, ls=style[column])
                ax.plot(steps, smooth(values), color=colour, lw=1.8, label=label, ls=style[column])
            else:
                ax.plot(steps, values, color=colour, lw=1.8, marker=".", label=label, ls=style[column])
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    shown = tuple(dict.fromkeys(c for c in panel.columns if c in drawn))
    if several:
        held_out_style: dict[str, Any] = dict(ls="--", marker="o", ms=4)  # Line2D's keyword arguments
        handles = [
            Line2D([], [], color="0.3", **(held_out_style if c.startswith(HELD_OUT) else dict(lw=1.8, ls=style[c])))
            for c in shown
        ]
        ax.legend(handles, shown, fontsize="small")
    elif shown != (panel.title,):  # a panel of one column is titled by it already
        ax.legend(fontsize="small")
    return shown


TRAINING_STYLES = ("-", ":", "-.")
"""Line styles of a panel's training columns when several runs share it (held-out columns are dashed)."""


def _colour(i: int) -> str:
    return f"C{i % 10}"


def main(args: list[str] | None = None) -> Curves:
    """``align plot RUN_DIR [RUN_DIR ...] [--output PATH] [--metrics NAME ...]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="align plot",
        description="Draw runs' curves (reward, KL, loss, accuracy and their held-out values, "
        "as logged) from their metrics.csv into a PNG. Several runs share the axes, one colour each.",
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="A run folder (<root>/version_N holding metrics.csv), or a root: all its version_N.",
    )
    parser.add_argument(
        "--output",
        "-o",
        default=None,
        help=f"PNG to write (default: RUN_DIR/{CURVES} for one run folder, ./{CURVES} otherwise).",
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Columns of metrics.csv to draw, one panel each (default: the reward, KL, loss, "
        "accuracy and margin panels that the runs logged).",
    )
    ns = parser.parse_args(sys.argv[1:] if args is None else args)
    output = ns.output or _default_output(ns.run_dirs)
    curves = plot_runs(ns.run_dirs, output, ns.metrics)
    print(f"curves: {curves.path}")
    return curves


def _default_output(run_dirs: Sequence[str]) -> Path:
    if len(run_dirs) == 1 and (Path(run_dirs[0]) / METRICS).is_file():
        return Path(run_dirs[0]) / CURVES
    return Path(CURVES)


__all__ = [
    "CURVES",
    "Curves",
    "PANELS",
    "Panel",
    "PlotError",
    "RunSeries",
    "choose_panels",
    "find_runs",
    "main",
    "plot_runs",
    "read_run",
    "smooth",
]
