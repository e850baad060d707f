"""A small quickstart run finished once per test module, for the tests that resume, damage or refuse it: its
command line, fit and a refused fit in the test's process, and a copy of the run for each test (the fixtures
`finished_run` and `run_copy` of tests/conftest.py)."""

from pathlib import Path

import pytest
from paths import QUICKSTART

from fl_lightning.commands.main import main

ROUNDS = 4
BASE = ["fit", "--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--federation.local_steps", "2",
        "--federation.eval_every", "2", "--checkpoint.every", "2", "--logger.progress_bar", "false"]


def fit(out_dir: Path, *extra: str) -> None:
    """The run, trained or resumed in out_dir (`--resume auto`), with extra settings after the others."""
    main([*BASE, "--federation.rounds", str(ROUNDS), "--resume", "auto", "--out_dir", str(out_dir), *extra])


def refused(capsys, out_dir: Path, *extra: str) -> str:
    """Runs fit expecting a refusal; returns stderr."""
    with pytest.raises(SystemExit) as exited:
        fit(out_dir, *extra)
    assert exited.value.code == 2
    return capsys.readouterr().err


def folder_snapshot(out_dir: Path) -> dict[str, bytes]:
    """Every file of the folder and its bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file()}
