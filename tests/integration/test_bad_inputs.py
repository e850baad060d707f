"""Every bad input to `fl-lightning fit` ends in one line on stderr, `error: <field>: expected ...,
got ...`, and exit status 2 before any training starts: never a traceback, never a metrics file.

The cases are the rows of the "Bad inputs" table of docs/reliability.md, read from it: each row's
arguments (added to configs/quickstart.yaml) and the exact line the user sees, so the page and what
the command prints cannot drift apart. `{tmp}` stands for the case's scratch folder (FILES writes the
files a case names there), and `...` for the part of a message that quotes a file's content.
"""

import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import QUICKSTART, REPOSITORY

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.commands.main import main

RELIABILITY_PAGE = REPOSITORY / "docs" / "reliability.md"
BAD_INPUTS_HEADING = "## Bad inputs"
ALGORITHMS = ", ".join(sorted(SHORT_NAMES))


@dataclass(frozen=True)
class BadInput:
    """One row of the page's table."""

    number: int
    description: str
    arguments: list[str]
    user_sees: str


def code_span(cell: str) -> str:
    """The text of a table cell that is one Markdown code span (`text`, or ``text`` where the text
    holds a backtick, read as CommonMark reads it: one space inside each end is dropped)."""
    match = re.fullmatch(r"(`+)(.*)\1", cell.strip())
    assert match is not None, f"a cell of docs/reliability.md's bad inputs that is not one code span: {cell!r}"
    text = match.group(2)
    return text[1:-1] if len(text) > 2 and text.startswith(" ") and text.endswith(" ") else text


def bad_inputs(page: str) -> list[BadInput]:
    """The rows of the page's "Bad inputs" table: `| # | bad input | arguments | what the user sees |`."""
    section = page.split(f"\n{BAD_INPUTS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].isdigit():
            number, description, arguments, user_sees = cells
            rows.append(BadInput(int(number), description, shlex.split(code_span(arguments)), code_span(user_sees)))
    return rows


BAD_INPUTS = bad_inputs(RELIABILITY_PAGE.read_text())


def is_the_line_shown(line: str, shown: str) -> bool:
    """Whether `line` is the line `shown` on the page, where `...` stands for any text."""
    return re.fullmatch(".*".join(re.escape(part) for part in shown.split("...")), line) is not None


def _cifar_copy(tmp: Path, name: str, cifar_root: Path) -> Path:
    folder = tmp / name / "cifar-10-batches-py"
    shutil.copytree(cifar_root / "cifar-10-batches-py", folder)
    return folder


FILES = {
    "binary.yaml": lambda tmp, _: (tmp / "binary.yaml").write_bytes(b"\x00\x01\x02garbage\xff\xfe"),
    "empty.yaml": lambda tmp, _: (tmp / "empty.yaml").write_text(""),
    "typo.yaml": lambda tmp, _: (tmp / "typo.yaml").write_text("federation:\n  roundz: 5\n"),
    "broken.yaml": lambda tmp, _: (tmp / "broken.yaml").write_text("federation: [\n"),
    "fedadam_nan.yaml": lambda tmp, _: (tmp / "fedadam_nan.yaml").write_text(
        "server_optimizer:\n  class_path: FedAdam\n  init_args:\n    tau: .nan\n"),
    "a_file": lambda tmp, _: (tmp / "a_file").write_text(""),
    "garbage.ckpt": lambda tmp, _: (tmp / "garbage.ckpt").write_bytes(bytes(range(256)) * 4),
    "used_run": lambda tmp, _: (tmp / "used_run").mkdir() or (tmp / "used_run" / "config.yaml").write_text("seed: 0\n"),
    "cifar_missing": lambda tmp, cifar: (_cifar_copy(tmp, "cifar_missing", cifar()) / "data_batch_3").unlink(),
    "cifar_corrupt": lambda tmp, cifar: (_cifar_copy(tmp, "cifar_corrupt", cifar()) / "data_batch_2").write_bytes(
        bytes(1000)),
}


@pytest.fixture
def offline_cpu_machine(monkeypatch):
    """No CUDA, no network and no cluster launcher, whatever machine the tests run on."""
    import os
    import urllib.error
    import urllib.request

    import torch

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in ("MASTER_ADDR", "NODE_RANK"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case.description for case in BAD_INPUTS])
def test_bad_input_is_one_error_line_before_training(case, tmp_path, capsys, request, offline_cpu_machine):
    for name, write in FILES.items():
        if any(f"{{tmp}}/{name}" in argument for argument in case.arguments):
            write(tmp_path, lambda: request.getfixturevalue("cifar_root"))
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in case.arguments]

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path / "run"), *arguments])

    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    (line,) = err.splitlines()
    assert is_the_line_shown(line, case.user_sees.replace("{tmp}", str(tmp_path))), \
        f"docs/reliability.md, bad input {case.number}, shows\n  {case.user_sees}\nbut the command prints\n  {line}"
    assert "Traceback" not in out + err
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_the_bad_inputs_table_is_read_whole():
    """Every row of the table is a case, numbered in order, each of one error line."""
    assert [case.number for case in BAD_INPUTS] == list(range(1, len(BAD_INPUTS) + 1))
    assert len(BAD_INPUTS) >= 76 and len({case.description for case in BAD_INPUTS}) == len(BAD_INPUTS)
    assert all(case.user_sees.startswith("error: ") and ": expected " in case.user_sees and ", got " in case.user_sees
               for case in BAD_INPUTS)


def test_a_cell_is_read_as_markdown_shows_it():
    assert code_span("`--seed -1`") == "--seed -1"
    assert code_span("`` error: see `fit --help`, got 'x' ``") == "error: see `fit --help`, got 'x'"
    assert is_the_line_shown("got 'checkpoint x is unreadable (EOF)'", "got 'checkpoint x is unreadable (...)'")
    assert not is_the_line_shown("got 'checkpoint y is unreadable (EOF)'", "got 'checkpoint x is unreadable (...)'")
    assert not is_the_line_shown("error: seed: expected an integer >= 0, got '-1'",
                                 "error: seed: expected an integer >= 1, got '-1'")


# A module of the user's on sys.path for each way a class path can fail.
USER_MODULES = {
    "raises_on_import": 'raise RuntimeError("a bug in the module")\n',
    "plain_classes": "class NotAComponent:\n    pass\n",
}
USER_MODULE_CAUSES = {
    "missing module": ("no_such_module.Thing", "no_such_module.Thing (ModuleNotFoundError: No module named "
                       "'no_such_module'; add its folder to PYTHONPATH)"),
    "missing class": ("plain_classes.Missing",
                      "plain_classes.Missing (AttributeError: module 'plain_classes' has no attribute 'Missing')"),
    "module raising on import": ("raises_on_import.Thing",
                                 "raises_on_import.Thing (RuntimeError: a bug in the module)"),
}
CALLBACKS = "a list of Callback subclasses (e.g. [{class_path: module.Class}]) or null"
ALGORITHM = f"an algorithm: one of {ALGORITHMS}, or an Algorithm subclass by class name or class path"


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    folder = tmp_path / "user_modules"
    folder.mkdir()
    for name, text in USER_MODULES.items():
        (folder / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    yield
    import sys

    for name in USER_MODULES:
        sys.modules.pop(name, None)


def one_error_line(arguments: list[str], tmp_path: Path, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path / "run"), *arguments])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert not (tmp_path / "run").exists()
    return line


@pytest.mark.parametrize("cause", [*USER_MODULE_CAUSES, "not a Callback"])
def test_a_callback_class_path_that_fails_names_its_cause(cause, tmp_path, capsys, user_modules):
    path, got = USER_MODULE_CAUSES.get(cause, ("plain_classes.NotAComponent",
                                               "plain_classes.NotAComponent (not a subclass of Callback)"))
    line = one_error_line(["--callbacks", f"[{{class_path: {path}}}]"], tmp_path, capsys)
    assert line == f"error: callbacks: expected {CALLBACKS}, got {got!r}"


def test_a_callback_class_path_in_a_config_file_names_its_cause(tmp_path, capsys, user_modules):
    config = tmp_path / "callbacks.yaml"
    config.write_text("callbacks:\n  - class_path: raises_on_import.Thing\n    init_args: {every: 2}\n")
    line = one_error_line(["--config", str(config)], tmp_path, capsys)
    assert line == f"error: callbacks: expected {CALLBACKS}, got {USER_MODULE_CAUSES['module raising on import'][1]!r}"


@pytest.mark.parametrize("cause", [*USER_MODULE_CAUSES, "not an Algorithm"])
def test_an_algorithm_class_path_that_fails_names_its_cause(cause, tmp_path, capsys, user_modules):
    path, got = USER_MODULE_CAUSES.get(cause, ("plain_classes.NotAComponent",
                                               "plain_classes.NotAComponent (not a subclass of Algorithm)"))
    line = one_error_line(["--algorithm", path], tmp_path, capsys)
    assert line == f"error: algorithm: expected {ALGORITHM}, got {got!r}"


def test_a_server_optimizer_whose_module_raises_is_one_line(tmp_path, capsys, user_modules):
    line = one_error_line(["--server_optimizer", "{class_path: raises_on_import.Thing}"], tmp_path, capsys)
    assert line.startswith("error: server_optimizer: expected a ServerOptimizer: one of ")
    assert line.endswith("got 'raises_on_import.Thing (RuntimeError: a bug in the module)'")
