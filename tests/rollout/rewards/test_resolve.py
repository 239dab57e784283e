"""Import paths of rewards and environments (align.rollout.rewards.resolve): dotted paths and files, from the
working directory and beside the file, one-line errors for a path that does not resolve or a module that fails to
import, and where an exception is pointed at."""

import sys

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import RewardError, RewardFunction, RewardSpec, resolve_import, resolve_reward, sort_format


def test_resolve_by_dotted_path_and_file(tmp_path, monkeypatch):
    assert resolve_reward("align.rewards.sort_format") is sort_format
    assert resolve_reward("align.rollout.rewards:sort_format") is sort_format
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward("my_rewards.py:brevity")
    assert fn(["p"], ["abc"]) == [0.25]


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.fn", "cannot import module 'no_such_pkg'"),
        ("align.rewards.no_such_fn", "has no attribute 'no_such_fn'"),
        ("missing.py:fn", "file 'missing.py' does not exist"),
        ("align.rollout.rewards.__doc__", "not a callable"),
        ("justaname", "expected an import path"),
    ],
)
def test_bad_import_paths_fail_clearly(path, message):
    with pytest.raises(AlignConfigError, match=message.replace("(", r"\(")):
        RewardFunction(RewardSpec(path))


def test_dotted_path_imports_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_a1.py").write_text(
        "def brevity(completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    fn = RewardFunction(RewardSpec("cwd_rewards_a1.brevity"))
    assert fn(["p"], ["abc"]) == [0.25]
    assert sys.path[-1] == str(tmp_path)  # searched last: never shadows an installed package


def test_a_file_path_imports_the_modules_beside_it_and_in_the_working_directory(tmp_path, monkeypatch):
    """``my_envs.py:Game`` (in the working directory) and ``envs/game.py:Game`` (in a folder) import their sibling
    modules, as the dotted form can, from a script whose own folder is first on sys.path (python recipes/grpo.py)."""
    (tmp_path / "sibling_helpers_c3.py").write_text("BONUS = 2.0\n")
    (tmp_path / "my_envs_c3.py").write_text("from sibling_helpers_c3 import BONUS\nclass Game:\n    bonus = BONUS\n")
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "nested_helpers_c3.py").write_text("VALUE = 3\n")
    (tmp_path / "envs" / "game_c3.py").write_text(
        "from nested_helpers_c3 import VALUE\n"
        "from sibling_helpers_c3 import BONUS\n"
        "class Game:\n    value = VALUE * BONUS\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("sibling_helpers_c3", "nested_helpers_c3"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert resolve_import("my_envs_c3.py:Game", what="environment").bonus == 2.0
    assert resolve_import("envs/game_c3.py:Game", what="environment").value == 6.0
    assert sys.path[-2:] == [str(tmp_path), str(tmp_path / "envs")]  # searched last


def test_a_module_that_fails_to_import_names_the_error_and_line(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_b2.py").write_text("import math\n\nVALUE = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        AlignConfigError,
        match=r"importing module 'cwd_rewards_b2' failed: ZeroDivisionError: "
        r"division by zero at cwd_rewards_b2.py, line 3",
    ):
        resolve_reward("cwd_rewards_b2.fn")


def test_a_built_in_reward_that_raises_points_at_its_own_file():
    with pytest.raises(
        RewardError,
        match=r"reward 'math_answer' \(align.rewards.math_answer\) raised ValueError: "
        r"math_answer needs an 'answer' column .* at .*align/rollout/rewards/builtin.py, "
        r"line \d+ in math_answer\(\); first failing sample 0 of 1: prompt 'q'",
    ):
        RewardFunction(RewardSpec("align.rewards.math_answer"))(["q"], ["1"])
