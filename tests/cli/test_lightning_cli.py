"""AlignCLI (align.cli.lightning_cli): its subcommands."""

import pytest

from align.cli.lightning_cli import AlignCLI
from align.cli.main import main


def fails(capsys, *args) -> str:
    """The one stderr line of a command that must exit 2."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("name", ["test", "predict"])
def test_test_and_predict_are_not_subcommands(capsys, name):
    assert set(AlignCLI.subcommands()) == {"fit", "validate"}
    assert "use 'align evaluate'" in fails(capsys, name, "--config", "align:grpo/tiny.yaml")
