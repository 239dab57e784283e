"""The user-facing errors (``align.errors``): every one a user can fix is an ``AlignError``; a data error names the
file, the row and the field; a class's ``init_kwargs`` setting is placed under the setting that holds it."""

import pytest

from align.errors import (
    AlignConfigError,
    AlignDataError,
    AlignEnvError,
    AlignError,
    NoLearningSignalError,
    placed,
)


@pytest.mark.parametrize(
    "error, builtin",
    [
        (AlignConfigError, ValueError),
        (AlignDataError, ValueError),
        (AlignEnvError, RuntimeError),
        (NoLearningSignalError, RuntimeError),
    ],
)
def test_each_error_is_an_align_error_and_the_builtin_callers_catch(error, builtin):
    assert issubclass(error, AlignError) and issubclass(error, builtin)


def test_a_data_error_names_the_file_row_and_field_and_what_it_got():
    err = AlignDataError("d.jsonl", 3, "completion", "a non-empty string", "")
    assert str(err) == "d.jsonl: row 3: field 'completion': expected a non-empty string, got ''"
    assert (err.source, err.row, err.field, err.expected, err.got) == (
        "d.jsonl",
        3,
        "completion",
        "a non-empty string",
        "",
    )
    assert str(AlignDataError("d.jsonl", None, None, "at least one row")) == "d.jsonl: expected at least one row"
    assert str(AlignDataError("d.jsonl", 7, None, "a JSON object", [1, 2])) == (
        "d.jsonl: row 7: expected a JSON object, got [1, 2]"
    )


def test_a_long_value_is_cut_to_eighty_characters():
    message = str(AlignDataError("d.jsonl", 1, "prompt", "a string", b"x" * 200))
    got = message.split(", got ", 1)[1]
    assert len(got) == 80 and got == repr(b"x" * 200)[:77] + "..."


def test_an_init_kwargs_setting_is_placed_under_the_setting_holding_it():
    cause = OSError("no route")
    err = AlignConfigError("init_kwargs.timeout: expected a number > 0, got 0")
    err.__cause__ = cause
    moved = placed(err, "model.rewards[0]")
    assert type(moved) is AlignConfigError
    assert str(moved) == "model.rewards[0].init_kwargs.timeout: expected a number > 0, got 0"
    assert moved.__cause__ is cause
    whole = placed(AlignConfigError("init_kwargs: expected a mapping, got 3"), "model.environment")
    assert str(whole) == "model.environment.init_kwargs: expected a mapping, got 3"
    other = AlignConfigError("model.beta: expected > 0, got 0")
    assert placed(other, "model.rewards[0]") is other  # not an init_kwargs setting: left as it is
