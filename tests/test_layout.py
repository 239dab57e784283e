"""The tests mirror the package: the tests of ``align/<path>/<file>.py`` are in ``tests/<path>/test_<file>.py``. The
few files that have no such file are named here with the test that covers them."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, TESTS = ROOT / "align", ROOT / "tests"

COVERED_ELSEWHERE = {
    "__main__.py": "tests/cli/test_commands.py::test_python_dash_m_align_is_the_align_command",
    "rewards.py": "tests/test_import_layers.py::test_the_paths_users_write_in_configs_import",
    "strategies.py": "tests/test_import_layers.py::test_the_paths_users_write_in_configs_import",
    # verifiers cannot be installed beside TRL 1.x and vLLM 0.32 (pyproject.toml): these skip without it.
    "rollout/envs/verifiers_tasks.py": (
        "tests/rollout/envs/test_verifiers.py::test_info_columns_the_pool_and_a_cut_episode"
    ),
}
"""``{source file under align/: the test that covers it}``."""


def mirrored(source: Path) -> Path:
    relative = source.relative_to(PACKAGE)
    return TESTS.joinpath(*relative.parts[:-1], f"test_{source.stem}.py")


def test_every_source_file_has_its_mirrored_test_file():
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]
    missing = [str(p.relative_to(PACKAGE)) for p in sources if not mirrored(p).is_file()]
    assert sorted(missing) == sorted(COVERED_ELSEWHERE), (
        f"source files without tests/<path>/test_<file>.py: {sorted(set(missing) - set(COVERED_ELSEWHERE))}; "
        f"listed as covered elsewhere but mirrored or gone: {sorted(set(COVERED_ELSEWHERE) - set(missing))}"
    )


def test_what_covers_the_others_exists():
    for source, where in COVERED_ELSEWHERE.items():
        path, _, name = where.partition("::")
        assert (ROOT / path).is_file() and f"def {name}(" in (ROOT / path).read_text(), f"{source}: {where}"
