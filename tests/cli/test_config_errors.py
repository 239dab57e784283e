"""An old module path or a renamed setting in a config or on the command line fails on one line that names the new
place (align.cli.config_errors over the tables of align.moved)."""

import pytest

import align.moved
from align.cli.config_errors import one_line, setting_key
from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.data.sft import SFTDataModule
from align.modules.grpo import GRPOModule
from align.modules.sft import SFTModule
from align.moved import moved_message, renamed_message

RECIPES = {"sft": (SFTModule, SFTDataModule), "grpo": (GRPOModule, PromptDataModule)}


def recipe_error(capsys, tmp_path, recipe: str, *args: str) -> list[str]:
    with pytest.raises(SystemExit) as info:
        run_recipe(recipe, *RECIPES[recipe], args=[*args, "--trainer.max_steps", "0",
                                                   "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines


def yaml_file(tmp_path, text: str) -> str:
    path = tmp_path / "old.yaml"
    path.write_text(text)
    return str(path)


SCHEDULER_YAML = "model:\n  init_args:\n    scheduler:\n      class_path: align.optim.WarmupLR\n"


@pytest.mark.parametrize("args, setting, old", [
    (["--model.scheduler.class_path", "align.optim.WarmupLR"], "model.scheduler", "align.optim.WarmupLR"),
    (["--config", SCHEDULER_YAML], "model.scheduler", "align.optim.WarmupLR"),
    (["--model", "align.modules.classic.PPOGymModule"], "model", "align.modules.classic.PPOGymModule"),
    (["--trainer.callbacks+=align.checkpointing.AlignCheckpoint"], "trainer.callbacks",
     "align.checkpointing.AlignCheckpoint"),
], ids=["flag", "yaml", "model-class", "callback"])
def test_a_moved_class_path_names_its_new_place_on_one_line(capsys, tmp_path, args, setting, old):
    args = [yaml_file(tmp_path, a) if a == SCHEDULER_YAML else a for a in args]
    assert recipe_error(capsys, tmp_path, "sft", *args) == [f"error: --{setting}: {moved_message(old)}"]
    assert "align.trainer.optim.WarmupLR" in moved_message("align.optim.WarmupLR")  # the precise new path


def test_a_moved_environment_path_names_its_new_place_on_one_line(capsys, tmp_path):
    old = "align.envs.tools.ToolEnvironment"
    assert recipe_error(capsys, tmp_path, "grpo", "--model.environment", old) == [
        f"error: environment: {moved_message(old)}"]
    assert "align.rollout.envs.tools.ToolEnvironment" in moved_message(old)


@pytest.mark.parametrize("recipe, args, old", [
    ("sft", ["--model.no_such_group.x", "1"], "model.no_such_group.x"),
    ("sft", ["--config", "model:\n  init_args:\n    no_such_group:\n      x: 1\n"], "model.no_such_group.x"),
    ("grpo", ["--model.clip.no_such", "sequence"], "model.clip.no_such"),
    ("grpo", ["--config", "model:\n  init_args:\n    clip:\n      no_such: sequence\n"], "model.clip.no_such"),
    ("sft", ["--trainer.no_such", "1"], "trainer.no_such"),
    ("sft", ["--config", "trainer:\n  no_such: 1\n"], "trainer.no_such"),
], ids=["group-flag", "group-yaml", "field-flag", "field-yaml", "trainer-flag", "trainer-yaml"])
def test_a_renamed_setting_names_what_to_write_instead_on_one_line(capsys, tmp_path, monkeypatch, recipe, args, old):
    # The table's own rows are settings that still exist until the modules drop them: these rows stand in for them.
    for key in ("model.no_such_group", "model.clip.no_such", "trainer.no_such"):
        monkeypatch.setitem(align.moved.RENAMED_SETTINGS, key, "model.optimizer (a stand-in)")
    args = [yaml_file(tmp_path, a) if a.startswith(("model:", "trainer:")) else a for a in args]
    assert recipe_error(capsys, tmp_path, recipe, *args) == [f"error: --{renamed_message(old)}"]
    assert f"--{old}: this setting was renamed; write model.optimizer (a stand-in)" in f"--{renamed_message(old)}"


def test_without_a_renamed_row_an_unknown_setting_lists_the_accepted_ones(capsys, tmp_path):
    assert recipe_error(capsys, tmp_path, "grpo", "--model.clip.no_such", "x") == [
        "error: --model.clip.no_such: GRPOModule.clip has no setting 'no_such'; accepted: low, high"]
    line, = recipe_error(capsys, tmp_path, "sft", "--model.no_such_group.x", "1")
    assert line.startswith("error: --model.no_such_group.x: SFTModule has no setting 'no_such_group.x'; accepted: ")


def test_the_tables_own_rows_in_the_messages_jsonargparse_gives():
    # The message shapes jsonargparse gives once a setting is gone (recorded from the stand-in rows above).
    group_field = ("Parser key \"model\":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class "
                   "'align.modules.grpo.GRPOModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given "
                   "class_path 'align.modules.grpo.GRPOModule':\n        {}\n    - Expected a <class 'NoneType'>\n")
    assert one_line(group_field.format("Group 'clip' does not accept option 'level'")) == \
        "--" + renamed_message("model.clip.level")
    assert one_line(group_field.format("unrecognized arguments: --clip.level=sequence")) == \
        "--" + renamed_message("model.clip.level")
    assert one_line(group_field.format("Option 'dynamic_sampling.enabled' is not accepted")) == \
        "--" + renamed_message("model.dynamic_sampling.enabled")
    assert renamed_message("model.clip.level").startswith("model.clip.level: this setting was renamed; write "
                                                          "model.policy_loss.name")


def test_setting_keys_are_written_as_a_user_writes_them():
    assert setting_key("--model.init_args.clip.init_args.level=sequence") == "model.clip.level"
    assert setting_key("init_args.scheduler") == "scheduler"


@pytest.mark.parametrize("recipe, args, expected", [
    ("grpo", ["--model.class_path", "align.modules.grpo.GRPOModul"],
     "error: --model: cannot import 'align.modules.grpo.GRPOModul' (module 'align.modules.grpo' has no attribute "
     "'GRPOModul'); did you mean align.modules.grpo.GRPOModule?"),
    ("grpo", ["--data.class_path", "align.data.PromptDataModul"],
     "error: --data: cannot import 'align.data.PromptDataModul' (module 'align.data' has no attribute "
     "'PromptDataModul'); did you mean align.data.prompts.PromptDataModule?"),
    ("sft", ["--model.policy.class_path", "align.models.PolicyModl"],
     "error: --model.policy: cannot import 'align.models.PolicyModl' (module 'align.models' has no attribute "
     "'PolicyModl'); did you mean align.models.PolicyModel?"),
    ("sft", ["--model.scheduler.class_path", "align.trainer.optim.WarmupRL"],
     "error: --model.scheduler: cannot import 'align.trainer.optim.WarmupRL' (module 'align.trainer.optim' has no "
     "attribute 'WarmupRL'); did you mean align.trainer.optim.WarmupLR?"),
    ("grpo", ["--model.class_path", "align.modulez.grpo.GRPOModule"],
     "error: --model: cannot import 'align.modulez.grpo.GRPOModule' (ModuleNotFoundError: No module named "
     "'align.modulez'); did you mean align.modules.grpo.GRPOModule?"),
], ids=["module-class", "data-class-in-a-submodule", "nested-policy", "scheduler", "module-path"])
def test_a_class_path_that_does_not_import_is_named_with_the_nearest_one(capsys, tmp_path, recipe, args, expected):
    assert recipe_error(capsys, tmp_path, recipe, *args) == [expected]


def test_a_class_path_with_nothing_near_it_is_named_with_why_it_does_not_import(capsys, tmp_path):
    assert recipe_error(capsys, tmp_path, "sft", "--model.class_path", "no_such_pkg_x.Module") == [
        "error: --model: cannot import 'no_such_pkg_x.Module' (ModuleNotFoundError: No module named 'no_such_pkg_x')"]


def test_a_config_file_that_is_not_yaml_is_named_with_its_line_and_column(capsys, tmp_path):
    bad = tmp_path / "syntax.yaml"
    bad.write_text("trainer:\n  max_steps: 3\n   bad: [\n")
    assert recipe_error(capsys, tmp_path, "sft", "--config", str(bad)) == [
        f"error: --config: '{bad}', line 3, column 7: not valid YAML: mapping values are not allowed here"]
    assert recipe_error(capsys, tmp_path, "sft", f"--config={bad}")[0].startswith(f"error: --config: '{bad}', line 3")
