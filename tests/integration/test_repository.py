"""The repository stands alone: what a user reads or runs names no file outside a clone of it."""

import re
from pathlib import Path

import yaml
from paths import REPOSITORY

# What a user reads or runs; tests/ is left out, since this file has to spell the pattern out.
READ_BY_USERS = ["README.md", "CONTRIBUTING.md", "docs", "configs", "fl_lightning", "benchmarks", "examples", "slurm"]
# A folder beside the checkout (`../shared/...`) or an absolute path on the machine it was made on.
OUTSIDE = re.compile(r"shared/|/work/")


def text_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [file for file in files if "__pycache__" not in file.parts and file.suffix not in (".png", ".pyc")]


def test_no_file_points_outside_the_repository():
    found = [f"{file.relative_to(REPOSITORY)}:{number}: {line.strip()}"
             for entry in READ_BY_USERS for file in text_files(REPOSITORY / entry)
             for number, line in enumerate(file.read_text(errors="replace").splitlines(), start=1)
             if OUTSIDE.search(line)]
    assert found == []


def test_the_pattern_finds_a_pointer_outside_and_nothing_else():
    """The check above can fail: a line as the docs once had it is found, the word "shared" alone is not."""
    line = "python ../shared/tools/make_data.py --out data/"
    assert OUTSIDE.search(line)
    assert not OUTSIDE.search("Clients are shared over ranks; see docs/cluster.md")


def test_pre_commit_runs_the_ruff_of_make_lint():
    """The same ruff versions as the `test` extra, with the arguments of `make lint`."""
    (hook,) = [hook for repo in yaml.safe_load((REPOSITORY / ".pre-commit-config.yaml").read_text())["repos"]
               for hook in repo["hooks"]]
    (test_extra,) = re.findall(r"(?m)^test = \[(.*)\]$", (REPOSITORY / "pyproject.toml").read_text())
    assert hook["additional_dependencies"] == re.findall(r'"(ruff\b[^"]*)"', test_extra)
    (lint,) = re.findall(r"(?m)^lint:.*\n\t\$\(VENV\)/bin/(.+)$", (REPOSITORY / "Makefile").read_text())
    assert hook["entry"] == lint
    assert hook["pass_filenames"] is False  # ruff checks the folders, as make lint does


# A test file, or a test in one, as the docs and the tests' own docstrings name them.
TEST_REFERENCE = re.compile(r"(?<![\w/])(tests/[\w/]*test_\w+\.py)(?:::(test_\w+))?")
NAMED_TESTS_IN = [*READ_BY_USERS, "tests"]


def test_every_test_file_and_test_the_docs_name_exists():
    """A page that points to a test that was moved or renamed points nowhere."""
    tests_of = {}
    for path in (REPOSITORY / "tests").rglob("test_*.py"):
        tests_of[path.relative_to(REPOSITORY).as_posix()] = set(re.findall(r"(?m)^def (test_\w+)", path.read_text()))
    dangling = [f"{file.relative_to(REPOSITORY)}: {match.group(0)}"
                for entry in NAMED_TESTS_IN for file in text_files(REPOSITORY / entry)
                for match in TEST_REFERENCE.finditer(file.read_text(errors="replace"))
                if match.group(2) not in tests_of.get(match.group(1), set()) | {None}
                or match.group(1) not in tests_of]
    assert dangling == []
    # The check can fail: a reference to a test that is not there is found (spelt in two parts here,
    # or this file would name it).
    gone = "tests/test_nowhere" + ".py::test_gone"
    assert TEST_REFERENCE.search(f"see {gone}").groups() == (gone.partition("::")[0], "test_gone")
