"""``align plot`` and the run's ``curves.png``: panels chosen from the columns a module logs, several runs on
the same axes, and one-line errors."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest

from align.cli.main import main
from align.cli.plots import PlotError, plot_runs, read_run, smooth

GRPO_TRAIN = (
    "rollout/reward_mean",
    "rollout/reward_std",
    "train/kl",
    "train/loss",
    "train/entropy",
    "time/generation_s",
)
GRPO_VAL = ("val/reward_mean", "val/accuracy", "val/response_length")
DPO_TRAIN = ("train/loss", "dpo/accuracy", "dpo/margin", "train/pairs_per_s")
DPO_VAL = ("val/loss", "val/dpo_accuracy", "val/dpo_margin")


def write_run(
    directory: Path,
    train: tuple[str, ...],
    val: tuple[str, ...],
    steps: int = 30,
    scale: float = 1.0,
    val_every: int = 10,
) -> Path:
    """A ``metrics.csv`` shaped like Lightning's: a training row per step and a validation row every
    ``val_every`` steps, each leaving the other's columns empty."""
    directory.mkdir(parents=True, exist_ok=True)
    columns = ["epoch", "step", *sorted(train + val)]
    with open(directory / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for step in range(steps):
            if step % val_every == 0:
                writer.writerow({"epoch": 0, "step": step, **{c: scale * (0.5 + 0.01 * step) for c in val}})
            writer.writerow(
                {"epoch": 0, "step": step, **{c: scale * (0.1 + 0.02 * step + 0.05 * (step % 3)) for c in train}}
            )
        writer.writerow({"epoch": 1, "step": steps, **{c: scale * 0.9 for c in val}})
    return directory


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_grpo_run_gets_reward_kl_loss_and_accuracy_panels(tmp_path):
    run = write_run(tmp_path / "grpo" / "version_0", GRPO_TRAIN, GRPO_VAL)
    curves = plot_runs([run], tmp_path / "out.png")
    assert curves.panels == (
        ("reward", ("rollout/reward_mean", "val/reward_mean")),
        ("KL to the reference", ("train/kl",)),
        ("loss", ("train/loss",)),
        ("accuracy", ("val/accuracy",)),
    )
    assert curves.runs == ("grpo/version_0",)
    width, height = png_size(curves.path)
    assert 800 <= width <= 1600 and 500 <= height <= 1200


def test_dpo_run_gets_loss_accuracy_and_margin_panels_and_no_empty_ones(tmp_path):
    run = write_run(tmp_path / "dpo" / "version_3", DPO_TRAIN, DPO_VAL)
    curves = plot_runs([run], tmp_path / "out.png")
    assert [title for title, _ in curves.panels] == ["loss", "accuracy", "margin"]
    assert dict(curves.panels)["accuracy"] == ("dpo/accuracy", "val/dpo_accuracy")
    assert png_size(curves.path)[0] > 0


def test_distillation_run_gets_a_teacher_distance_panel_and_the_teachers_accuracy(tmp_path):
    run = write_run(
        tmp_path / "distill" / "version_0",
        ("rollout/reward_mean", "distill/reverse_kl", "train/loss"),
        ("val/reward_mean", "val/accuracy", "val/teacher_accuracy"),
    )
    panels = dict(plot_runs([run], tmp_path / "out.png").panels)
    assert panels["distance to the teacher"] == ("distill/reverse_kl",)
    assert panels["accuracy"] == ("val/accuracy", "val/teacher_accuracy")


def test_validation_only_csv_draws_its_held_out_columns(tmp_path):
    run = write_run(tmp_path / "sft" / "version_0", (), ("val/loss", "val/ppl"))
    assert plot_runs([run], tmp_path / "out.png").panels == (("loss", ("val/loss",)),)


def test_columns_no_panel_knows_get_a_panel_each_up_to_six(tmp_path):
    names = tuple(f"trpo/m{i}" for i in range(8))
    run = write_run(tmp_path / "v", names, ())
    assert plot_runs([run], tmp_path / "out.png").panels == tuple((n, (n,)) for n in names[:6])


def test_gaps_repeated_steps_and_non_finite_cells(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "epoch,step,train/loss,val/loss\n"
        "0,0,1.0,\n"
        "0,0,,2.0\n"
        "0,1,nan,\n"
        "0,2,0.5,\n"
        "0,1,0.7,\n"  # a resumed run logs step 1 again: the later value is kept
        "0,3,inf,\n"
    )
    run = read_run(tmp_path)
    assert run.series["train/loss"] == ([0.0, 1.0, 2.0], [1.0, 0.7, 0.5])
    assert run.series["val/loss"] == ([0.0], [2.0])


def test_several_runs_share_the_axes_and_a_root_means_all_its_runs(tmp_path):
    write_run(tmp_path / "grpo" / "version_0", GRPO_TRAIN, GRPO_VAL)
    write_run(tmp_path / "grpo" / "version_1", ("rollout/reward_mean", "train/loss"), ("val/reward_mean",), scale=2.0)
    (tmp_path / "grpo" / "version_2").mkdir()  # a run that failed before logging: skipped
    by_root = plot_runs([tmp_path / "grpo"], tmp_path / "root.png")
    assert by_root.runs == ("grpo/version_0", "grpo/version_1")
    # Panels are the union: version_1 logged no KL, version_0 did.
    assert [t for t, _ in by_root.panels] == ["reward", "KL to the reference", "loss", "accuracy"]
    explicit = plot_runs([tmp_path / "grpo" / "version_1", tmp_path / "grpo" / "version_0"], tmp_path / "two.png")
    assert explicit.runs == ("grpo/version_1", "grpo/version_0")
    assert png_size(explicit.path) == png_size(by_root.path)


def test_same_version_names_under_different_roots_get_told_apart(tmp_path):
    a = write_run(tmp_path / "lr1" / "grpo" / "version_0", GRPO_TRAIN, GRPO_VAL)
    b = write_run(tmp_path / "lr2" / "grpo" / "version_0", GRPO_TRAIN, GRPO_VAL)
    assert plot_runs([a, b], tmp_path / "out.png").runs == ("lr1/grpo/version_0", "lr2/grpo/version_0")


def test_chosen_metrics_get_one_panel_each(tmp_path):
    run = write_run(tmp_path / "v", GRPO_TRAIN, GRPO_VAL)
    curves = plot_runs([run], tmp_path / "out.png", metrics=["train/entropy", "val/response_length"])
    assert curves.panels == (("train/entropy", ("train/entropy",)), ("val/response_length", ("val/response_length",)))
    with pytest.raises(PlotError, match=r"--metrics: train/nope not logged by .*; available: .*train/entropy"):
        plot_runs([run], tmp_path / "out.png", metrics=["train/nope"])


def test_smooth_is_a_debiased_moving_average():
    assert smooth([1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0]
    assert smooth([0.0, 3.0]) == [0.0, 2.0]  # span 3: weight 1/2; (0.5 * 3) / (1 - 0.25)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_align_plot_writes_into_a_single_run_folder_by_default(tmp_path, capsys):
    run = write_run(tmp_path / "grpo" / "version_0", GRPO_TRAIN, GRPO_VAL)
    main(["plot", str(run)])
    assert capsys.readouterr().out.strip() == f"curves: {run / 'curves.png'}"
    main(["plot", str(run), str(run), "--output", str(tmp_path / "cmp.png"), "--metrics", "train/kl"])
    assert (tmp_path / "cmp.png").is_file()


def test_align_plot_folder_without_metrics_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plot", str(tmp_path / "nothing")])
    assert info.value.code == 2
    line = one_error_line(capsys)
    assert str(tmp_path / "nothing") in line and "expected a run folder" in line and "metrics.csv" in line


def test_align_plot_unreadable_csv_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_bytes(b"step,train/loss\n\xff\xfe\x00\n")
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "cannot be read as a CSV file" in one_error_line(capsys)


@pytest.mark.parametrize("content", ["", "epoch,step,train/loss\n"])
def test_align_plot_empty_csv_is_one_line(tmp_path, capsys, content):
    (tmp_path / "metrics.csv").write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["plot", str(tmp_path)])
    assert info.value.code == 2
    assert "no metrics logged" in one_error_line(capsys)
    assert not (tmp_path / "curves.png").exists()


def test_align_plot_unknown_metric_lists_the_available_ones(tmp_path, capsys):
    run = write_run(tmp_path / "v", DPO_TRAIN, DPO_VAL)
    with pytest.raises(SystemExit) as info:
        main(["plot", str(run), "--metrics", "train/kl"])
    assert info.value.code == 2
    line = one_error_line(capsys)
    assert "train/kl not logged" in line and "available: dpo/accuracy, dpo/margin" in line


def test_an_asynchronous_runs_staleness_and_waiting_panels_tell_columns_apart_by_line_style(tmp_path, monkeypatch):
    import align.cli.plots as plots

    train = GRPO_TRAIN + (
        "rollout/staleness",
        "rollout/policy_version_lag",
        "time/trainer_idle_s",
        "time/generator_idle_s",
    )
    runs = [write_run(tmp_path / name / "version_0", train, GRPO_VAL) for name in ("k1", "k2")]
    legends = {}
    original = plots._draw_panel

    def spy(ax, runs, panel):
        drawn = original(ax, runs, panel)
        legend = ax.get_legend()
        legends[panel.title] = [h.get_linestyle() for h in legend.legend_handles] if legend else []
        return drawn

    monkeypatch.setattr(plots, "_draw_panel", spy)
    curves = plot_runs(runs, tmp_path / "out.png")
    assert ("staleness", ("rollout/staleness", "rollout/policy_version_lag")) in curves.panels
    assert ("waiting (s)", ("time/trainer_idle_s", "time/generator_idle_s")) in curves.panels
    # Colour is the run's: a panel's second training column is drawn dotted, in the plot and its legend.
    assert legends["staleness"] == ["-", ":"] and legends["waiting (s)"] == ["-", ":"]
    assert legends["reward"] == ["-", "--"]  # the held-out column stays dashed
