"""A misspelt or unknown setting or class path, in a config or on the command line, fails on one line that names
the setting and what it accepts or the nearest importable path (align.cli.config_errors)."""

import pytest

from align.cli.config_errors import nearest, one_line, setting_key
from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.data.sft import SFTDataModule
from align.modules.grpo import GRPOModule
from align.modules.sft import SFTModule

RECIPES = {"sft": (SFTModule, SFTDataModule), "grpo": (GRPOModule, PromptDataModule)}


def recipe_error(capsys, tmp_path, recipe: str, *args: str) -> list[str]:
    with pytest.raises(SystemExit) as info:
        run_recipe(
            recipe,
            *RECIPES[recipe],
            args=[*args, "--trainer.max_steps", "0", "--trainer.default_root_dir", str(tmp_path / "runs")],
        )
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines


def yaml_file(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


SFT_ACCEPTED = "accepted: policy, optimizer, scheduler"


@pytest.mark.parametrize(
    "recipe, args, expected",
    [
        (
            "sft",
            ["--model.no_such_group.x", "1"],
            f"--model.no_such_group.x: SFTModule has no setting 'no_such_group.x'; {SFT_ACCEPTED}",
        ),
        (
            "sft",
            ["--config", "model:\n  init_args:\n    no_such_group:\n      x: 1\n"],
            f"--model.no_such_group.x: SFTModule has no setting 'no_such_group.x'; {SFT_ACCEPTED}",
        ),
        (
            "grpo",
            ["--model.clip.hihg", "0.1"],
            "--model.clip.hihg: GRPOModule.clip has no setting 'hihg'; did you mean high?",
        ),
        (
            "grpo",
            ["--config", "model:\n  init_args:\n    clip:\n      hihg: 0.1\n"],
            "--model.clip.hihg: GRPOModule.clip has no setting 'hihg'; did you mean high?",
        ),
        (
            "grpo",
            ["--model.clip.no_such", "0.1"],
            "--model.clip.no_such: GRPOModule.clip has no setting 'no_such'; accepted: low, high",
        ),
        ("sft", ["--trainer.no_such", "1"], "--trainer.no_such: no such setting"),
        ("sft", ["--config", "trainer:\n  no_such: 1\n"], "--trainer.no_such: no such setting"),
    ],
    ids=["group-flag", "group-yaml", "field-flag", "field-yaml", "field-far", "trainer-flag", "trainer-yaml"],
)
def test_an_unknown_setting_names_what_is_accepted_on_one_line(capsys, tmp_path, recipe, args, expected):
    args = [yaml_file(tmp_path, a) if a.startswith(("model:", "trainer:")) else a for a in args]
    assert recipe_error(capsys, tmp_path, recipe, *args) == [f"error: {expected}"]


def test_the_messages_jsonargparse_gives_for_an_unknown_setting_become_one_line():
    # The message shapes jsonargparse gives for a setting a class does not take, inside its union of subtypes.
    group_field = (
        'Parser key "model":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
        "'align.modules.grpo.GRPOModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given "
        "class_path 'align.modules.grpo.GRPOModule':\n        {}\n    - Expected a <class 'NoneType'>\n"
    )
    clip_hihg = "--model.clip.hihg: GRPOModule.clip has no setting 'hihg'; did you mean high?"
    assert one_line(group_field.format("Group 'clip' does not accept option 'hihg'")) == clip_hihg
    assert one_line(group_field.format("unrecognized arguments: --clip.hihg=0.1")) == clip_hihg
    assert one_line(group_field.format("Option 'no_such.enabled' is not accepted")).startswith(
        "--model.no_such.enabled: GRPOModule has no setting 'no_such.enabled'; accepted: policy, "
    )


def test_setting_keys_are_written_as_a_user_writes_them():
    assert setting_key("--model.init_args.clip.init_args.low=0.1") == "model.clip.low"
    assert setting_key("init_args.scheduler") == "scheduler"


@pytest.mark.parametrize(
    "recipe, args, expected",
    [
        (
            "grpo",
            ["--model.class_path", "align.modules.grpo.GRPOModul"],
            "error: --model: cannot import 'align.modules.grpo.GRPOModul' (module 'align.modules.grpo' has no "
            "attribute "
            "'GRPOModul'); did you mean align.modules.grpo.GRPOModule?",
        ),
        (
            "grpo",
            ["--data.class_path", "align.data.PromptDataModul"],
            "error: --data: cannot import 'align.data.PromptDataModul' (module 'align.data' has no attribute "
            "'PromptDataModul'); did you mean align.data.prompts.PromptDataModule?",
        ),
        (
            "sft",
            ["--model.policy.class_path", "align.models.PolicyModl"],
            "error: --model.policy: cannot import 'align.models.PolicyModl' (module 'align.models' has no attribute "
            "'PolicyModl'); did you mean align.models.PolicyModel?",
        ),
        (
            "sft",
            ["--model.scheduler.class_path", "align.trainer.optim.WarmupRL"],
            "error: --model.scheduler: cannot import 'align.trainer.optim.WarmupRL' (module 'align.trainer.optim' "
            "has no "
            "attribute 'WarmupRL'); did you mean align.trainer.optim.WarmupLR?",
        ),
        (
            "sft",
            ["--config", "model:\n  init_args:\n    scheduler:\n      class_path: align.trainer.optim.WarmupRL\n"],
            "error: --model.scheduler: cannot import 'align.trainer.optim.WarmupRL' (module 'align.trainer.optim' "
            "has no "
            "attribute 'WarmupRL'); did you mean align.trainer.optim.WarmupLR?",
        ),
        (
            "sft",
            ["--trainer.callbacks+=align.trainer.checkpointing.AlignCheckpont"],
            "error: --trainer.callbacks: cannot import 'align.trainer.checkpointing.AlignCheckpont' (module "
            "'align.trainer.checkpointing' has no attribute 'AlignCheckpont'); did you mean "
            "align.trainer.checkpointing.AlignCheckpoint?",
        ),
        (
            "grpo",
            ["--model.class_path", "align.modulez.grpo.GRPOModule"],
            "error: --model: cannot import 'align.modulez.grpo.GRPOModule' (ModuleNotFoundError: No module named "
            "'align.modulez'); did you mean align.modules.grpo.GRPOModule?",
        ),
    ],
    ids=[
        "module-class",
        "data-class-in-a-submodule",
        "nested-policy",
        "scheduler",
        "scheduler-yaml",
        "callback",
        "module-path",
    ],
)
def test_a_class_path_that_does_not_import_is_named_with_the_nearest_one(capsys, tmp_path, recipe, args, expected):
    args = [yaml_file(tmp_path, a) if a.startswith("model:") else a for a in args]
    assert recipe_error(capsys, tmp_path, recipe, *args) == [expected]


def test_an_environment_path_that_does_not_import_is_named_on_one_line(capsys, tmp_path):
    assert recipe_error(capsys, tmp_path, "grpo", "--model.environment", "align.rollout.envs.tools.ToolEnvironmnt") == [
        "error: environment 'align.rollout.envs.tools.ToolEnvironmnt': module 'align.rollout.envs.tools' has no "
        "attribute 'ToolEnvironmnt'"
    ]


def test_a_class_path_with_nothing_near_it_is_named_with_why_it_does_not_import(capsys, tmp_path):
    assert recipe_error(capsys, tmp_path, "sft", "--model.class_path", "no_such_pkg_x.Module") == [
        "error: --model: cannot import 'no_such_pkg_x.Module' (ModuleNotFoundError: No module named 'no_such_pkg_x')"
    ]


def test_a_config_file_that_is_not_yaml_is_named_with_its_line_and_column(capsys, tmp_path):
    bad = tmp_path / "syntax.yaml"
    bad.write_text("trainer:\n  max_steps: 3\n   bad: [\n")
    assert recipe_error(capsys, tmp_path, "sft", "--config", str(bad)) == [
        f"error: --config: '{bad}', line 3, column 7: not valid YAML: mapping values are not allowed here"
    ]
    assert recipe_error(capsys, tmp_path, "sft", f"--config={bad}")[0].startswith(f"error: --config: '{bad}', line 3")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.sampling.temperature", "-1"], "model.sampling.temperature: expected >= 0 (0: greedy), got -1.0"),
        (
            ["--model.evaluation.sampling.top_p", "0"],
            "model.evaluation.sampling.top_p: expected a value in (0, 1], got 0.0",
        ),
        (
            ["--model.sampling.engine", "align.rollout.vllm_engine.VLLMEngine", "--model.sampling.engine.dtype", "fp8"],
            "model.sampling.engine.dtype: expected auto, float32, bfloat16 or float16, got 'fp8'",
        ),
        (
            [
                "--config",
                "model:\n  init_args:\n    sampling:\n      engine:\n        class_path: "
                "align.rollout.engine.NativeEngine\n        init_args: {fast_decoder: 3}\n",
            ],
            "--model.sampling.engine.fast_decoder: expected bool, got '3'",
        ),
    ],
    ids=["sampling", "held-out-sampling", "engine-setting", "engine-setting-type"],
)
def test_a_bad_value_of_a_nested_setting_or_an_engines_own_is_one_line(capsys, tmp_path, args, expected):
    """An option class's own check (an engine given by class_path sits in a union with its short names, where
    jsonargparse keeps the error only as text) reaches the user as its one line, not a traceback."""
    args = [yaml_file(tmp_path, a) if a.startswith("model:") else a for a in args]
    assert recipe_error(capsys, tmp_path, "grpo", *args) == [f"error: {expected}"]


def test_unknown_yaml_key_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        run_recipe("sft", SFTModule, SFTDataModule, args=["--model.init_args.no_such_option", "1"])
    assert info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err


def sft_error(capsys, *args) -> list[str]:
    with pytest.raises(SystemExit) as info:
        run_recipe("sft", SFTModule, SFTDataModule, args=[*args, "--trainer.max_steps", "0"])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.max_steps", "ten"], "error: --trainer.max_steps: expected int, got 'ten'"),
        (["--trainer.max_stepz", "4"], "error: --trainer.max_stepz: no such setting; did you mean trainer.max_steps"),
        (["--model.optimizer.lrr", "1"], "error: --model.optimizer.lrr: AdamW has no setting 'lrr'; did you mean lr?"),
        (["--model.optimizer.lr", "abc"], "error: --model.optimizer.lr: expected float or Tensor, got 'abc'"),
        (
            ["--model.max_lenght", "5"],
            "error: --model.max_lenght: SFTModule has no setting 'max_lenght'; accepted: policy, optimizer, scheduler",
        ),
        (["--data.batch_size", "x"], "error: --data.batch_size: expected int, got 'x'"),
    ],
)
def test_a_bad_setting_is_one_line(capsys, args, expected):
    lines = sft_error(capsys, *args)
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_an_unknown_key_in_a_yaml_file_is_one_line_with_the_nearest_keys(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  max_stepz: 3\nmodel:\n  init_args:\n    optimizer:\n      init_args:\n        lr: 1\n"
    )
    assert sft_error(capsys, "--config", str(config)) == [
        "error: --trainer.max_stepz: no such setting; did you mean trainer.max_steps or trainer.max_time or "
        "trainer.min_steps?"
    ]


def test_one_line_of_messages_it_does_not_know_keeps_their_words():
    assert one_line("something\n   went   wrong") == "something went wrong"
    assert nearest("trainer.max_stepz", ["trainer.max_steps", "model.lr", "trainer.devices"]) == ["trainer.max_steps"]
    assert nearest("zzz", ["trainer.max_steps"]) == []
