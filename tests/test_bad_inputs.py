"""Every bad input to `fl-lightning fit` ends in one line on stderr, `error: <field>: expected ...,
got ...`, and exit status 2 before any training starts: never a traceback, never a metrics file.

BAD_INPUTS maps a description of each case to the arguments added to configs/quickstart.yaml, the
field the error names, and the exact line the user sees, so a documentation table can be made
from it. `{tmp}` stands for the case's scratch folder; FILES writes the files a case names there.
The lines of WORDED_ELSEWHERE come from checks in fit, the algorithms, the models and the run
folder; their wording belongs to those modules, so for them only the field and the form are checked.
"""

import shutil
from pathlib import Path

import pytest

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.cli.main import main

QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
ALGORITHMS = ", ".join(sorted(SHORT_NAMES))
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

# description -> (arguments after `fit --config configs/quickstart.yaml`, field named, what the user sees)
BAD_INPUTS: dict[str, tuple[list[str], str, str]] = {
    # Types and ranges, refused while parsing.
    "negative seed": (
        ["--seed", "-1"], "seed", "error: seed: expected an integer >= 0, got '-1'"),
    "seed not an integer": (
        ["--seed", "abc"], "seed", "error: seed: expected an integer >= 0, got 'abc'"),
    "zero rounds": (
        ["--federation.rounds", "0"], "federation.rounds",
        "error: federation.rounds: expected an integer > 0, got '0'"),
    "fractional rounds": (
        ["--federation.rounds", "1.5"], "federation.rounds",
        "error: federation.rounds: expected an integer > 0, got '1.5'"),
    "no clients per round": (
        ["--federation.clients_per_round", "0"], "federation.clients_per_round",
        "error: federation.clients_per_round: expected an integer > 0, got '0'"),
    "negative eval_every": (
        ["--federation.eval_every", "-1"], "federation.eval_every",
        "error: federation.eval_every: expected an integer > 0, got '-1'"),
    "unknown weighting": (
        ["--federation.weighting", "x"], "federation.weighting",
        "error: federation.weighting: expected one of num_samples, uniform or null, got 'x'"),
    "a group given a number": (
        ["--federation", "3"], "federation",
        "error: federation: expected a mapping of federation settings (rounds, num_clients, clients_per_round, "
        "local_steps, local_epochs, batch_size, eval_every, eval_batch_size, weighting) or a YAML file of them, "
        "got '3'"),
    "alpha zero": (
        ["--data.alpha", "0"], "data.alpha", "error: data.alpha: expected a finite number > 0, got '0'"),
    "alpha negative": (
        ["--data.alpha", "-1"], "data.alpha", "error: data.alpha: expected a finite number > 0, got '-1'"),
    "alpha infinite": (
        ["--data.alpha", "inf"], "data.alpha", "error: data.alpha: expected a finite number > 0, got 'inf'"),
    "alpha not a number": (
        ["--data.alpha", "abc"], "data.alpha", "error: data.alpha: expected a finite number > 0, got 'abc'"),
    "negative min_samples": (
        ["--data.min_samples", "-1"], "data.min_samples",
        "error: data.min_samples: expected an integer >= 0, got '-1'"),
    "download not a boolean": (
        ["--data.download", "maybe"], "data.download", "error: data.download: expected true or false, got 'maybe'"),
    "client lr infinite": (
        ["--client_optimizer.lr", "inf"], "client_optimizer.lr",
        "error: client_optimizer.lr: expected a finite number > 0, got 'inf'"),
    "client lr nan": (
        ["--client_optimizer.lr", "nan"], "client_optimizer.lr",
        "error: client_optimizer.lr: expected a finite number > 0, got 'nan'"),
    "client lr overflowing": (
        ["--client_optimizer.lr", "1e999"], "client_optimizer.lr",
        "error: client_optimizer.lr: expected a finite number > 0, got '1e999'"),
    "client lr negative": (
        ["--client_optimizer.lr", "-0.1"], "client_optimizer.lr",
        "error: client_optimizer.lr: expected a finite number > 0, got '-0.1'"),
    "weight decay infinite": (
        ["--client_optimizer.weight_decay", "inf"], "client_optimizer.weight_decay",
        "error: client_optimizer.weight_decay: expected a finite number >= 0, got 'inf'"),
    "weight decay nan": (
        ["--client_optimizer.weight_decay", "nan"], "client_optimizer.weight_decay",
        "error: client_optimizer.weight_decay: expected a finite number >= 0, got 'nan'"),
    "gradient clip infinite": (
        ["--client_optimizer.grad_clip_norm", "inf"], "client_optimizer.grad_clip_norm",
        "error: client_optimizer.grad_clip_norm: expected a finite number > 0 or null, got 'inf'"),
    "server lr infinite": (
        ["--server_optimizer.lr", "inf"], "server_optimizer.lr",
        "error: server_optimizer.lr: expected a finite number, got 'inf'"),
    "server lr overflowing": (
        ["--server_optimizer.lr", "1e999"], "server_optimizer.lr",
        "error: server_optimizer.lr: expected a finite value > 0, got inf"),
    "server lr negative": (
        ["--server_optimizer.lr", "-1"], "server_optimizer.lr",
        "error: server_optimizer.lr: expected a finite value > 0, got -1.0"),
    "FedAdam tau nan in a config": (
        ["--config", "{tmp}/fedadam_nan.yaml"], "server_optimizer.tau",
        "error: server_optimizer.tau: expected a finite value > 0, got nan"),
    "process group timeout zero": (
        ["--fabric.process_group_timeout_s", "0"], "fabric.process_group_timeout_s",
        "error: fabric.process_group_timeout_s: expected an integer > 0, got '0'"),
    "zero devices": (
        ["--fabric.devices", "0"], "fabric.devices",
        "error: fabric.devices: expected an integer > 0 or one of auto, got '0'"),
    "model options not a mapping": (
        ["--model.options", "[1,2]"], "model.options",
        "error: model.options: expected a mapping (e.g. {key: value}), got '[1,2]'"),
    "tags not a list": (
        ["--logger.tags", "5"], "logger.tags",
        "error: logger.tags: expected a list of strings (e.g. [a, b]), got '5'"),
    # Checks across fields, or against the machine or the data, before training.
    "more clients per round than clients": (
        ["--federation.clients_per_round", "11"], "federation.clients_per_round",
        "error: federation.clients_per_round: expected an integer from 1 to federation.num_clients (10), got 11"),
    "both local budgets": (
        ["--federation.local_epochs", "1"], "federation.local_steps / federation.local_epochs",
        "error: federation.local_steps / federation.local_epochs: expected exactly one of the two set (the other "
        "null), got {'local_steps': 20, 'local_epochs': 1}"),
    "no local budget": (
        ["--federation.local_steps", "null"], "federation.local_steps / federation.local_epochs",
        "error: federation.local_steps / federation.local_epochs: expected exactly one of the two set (the other "
        "null), got {'local_steps': None, 'local_epochs': None}"),
    "client momentum 1": (
        ["--client_optimizer.momentum", "1"], "client_optimizer.momentum",
        "error: client_optimizer.momentum: expected a value in [0, 1), got 1.0"),
    "nesterov without momentum": (
        ["--client_optimizer.momentum", "0", "--client_optimizer.nesterov", "true"], "client_optimizer.momentum",
        "error: client_optimizer.momentum: expected > 0 when nesterov is true, got 0.0"),
    "server momentum 1": (
        ["--server_optimizer.momentum", "1"], "server_optimizer.momentum",
        "error: server_optimizer.momentum: expected a value in [0, 1), got 1.0"),
    "cuda on a machine without one": (
        ["--fabric.accelerator", "cuda"], "fabric.accelerator",
        "error: fabric.accelerator: expected cpu or auto on a machine where torch sees no CUDA GPU, got 'cuda'"),
    "16-mixed on the CPU": (
        ["--fabric.precision", "16-mixed"], "fabric.precision",
        "error: fabric.precision: expected 32-true or bf16-mixed on the CPU (16-mixed needs a GPU), got '16-mixed'"),
    "batch larger than every client": (
        ["--federation.batch_size", "100000"], "federation.batch_size",
        "error: federation.batch_size: expected at most the largest client's number of samples (203) with "
        "local_steps, got 100000"),
    "constraint on an algorithm without local training": (
        ["--algorithm", "ctpfl", "--constraint", "CONST"], "constraint",
        "error: constraint: expected null for CTPFL, which trains no local model, got 'CONST'"),
    "requeue signal not a signal": (
        ["--checkpoint.requeue_signal", "5"], "checkpoint.requeue_signal",
        "error: checkpoint.requeue_signal: expected a signal name such as SIGUSR1 (or null), got '5'"),
    # Names.
    "unknown algorithm": (
        ["--algorithm", "fedfoo"], "algorithm",
        f"error: algorithm: expected an algorithm: one of {ALGORITHMS}, or an Algorithm subclass by class name or "
        "class path, got 'fedfoo'"),
    "unknown algorithm for --algorithm.help": (
        ["--algorithm.help", "fedfoo"], "algorithm.help",
        f"error: algorithm.help: expected an algorithm: one of {ALGORITHMS}, or an Algorithm subclass by class "
        "name or class path, got 'fedfoo'"),
    "unknown server optimizer": (
        ["--server_optimizer", "FedFoo"], "server_optimizer",
        "error: server_optimizer: expected a ServerOptimizer: one of FedAdagrad, FedAdam, FedYogi, ServerSGD "
        "(class name or class path), got 'FedFoo'"),
    "unknown constraint": (
        ["--constraint", "Foo"], "constraint",
        "error: constraint: expected a Constraint: one of CONST (class name or class path) or null, got 'Foo'"),
    "unknown model": (
        ["--model.name", "no_such_net"], "model.name",
        "error: model.name: expected one of linear, mlp, lenet5, resnet18, vit_tiny or a timm model name, "
        "got 'no_such_net'"),
    "unknown norm": (
        ["--model.norm", "xx"], "model.norm", "error: model.norm: expected one of bn, gn, none, got 'xx'"),
    "unknown dataset": (
        ["--data.name", "mnist"], "data.name",
        "error: data.name: expected one of cifar10, cifar100, tiny_imagenet, digits, got 'mnist'"),
    "unknown partition": (
        ["--data.partition", "foo"], "data.partition",
        "error: data.partition: expected one of dirichlet, iid, shards, got 'foo'"),
    "unknown accelerator": (
        ["--fabric.accelerator", "tpu"], "fabric.accelerator",
        "error: fabric.accelerator: expected one of auto, cpu, cuda, gpu, mps, got 'tpu'"),
    "unknown strategy": (
        ["--fabric.strategy", "foo"], "fabric.strategy",
        "error: fabric.strategy: expected one of auto, ddp, ddp_spawn, got 'foo'"),
    # Unknown keys: the closest valid names, not the whole usage.
    "abbreviated key": (
        ["--federation.round", "5"], "federation.round",
        "error: federation.round: expected a known setting (did you mean federation.rounds or "
        "federation.clients_per_round?), got the unknown key '--federation.round'"),
    "misspelt key": (
        ["--federation.roundz", "5"], "federation.roundz",
        "error: federation.roundz: expected a known setting (did you mean federation.rounds or "
        "federation.clients_per_round?), got the unknown key '--federation.roundz'"),
    "misspelt group": (
        ["--fed.rounds", "3"], "fed.rounds",
        "error: fed.rounds: expected a known setting (did you mean federation.rounds?), "
        "got the unknown key '--fed.rounds'"),
    "unknown option": (
        ["--nonsense"], "nonsense",
        "error: nonsense: expected a known setting (see `fl-lightning fit --help`), got the unknown key '--nonsense'"),
    "misspelt algorithm setting": (
        ["--algorithm", "ctpfl", "--algorithm.spam", "1"], "algorithm.spam",
        "error: algorithm.spam: expected a known setting (did you mean algorithm.span or algorithm.clip_norm?), "
        "got the unknown key '--algorithm.spam'"),
    "setting of an algorithm not chosen": (
        ["--algorithm.span", "0.3"], "algorithm.span",
        "error: algorithm.span: expected no setting under algorithm (FedAvg takes none; give --algorithm before "
        "the settings of the class it names), got the unknown key '--algorithm.span'"),
    "positional argument": (
        ["extra"], "arguments",
        "error: arguments: expected --group.field value pairs (no positional arguments), got 'extra'"),
    "unknown key in a YAML config": (
        ["--config", "{tmp}/typo.yaml"], "federation.roundz",
        "error: federation.roundz: expected a known setting (did you mean federation.rounds or "
        "federation.clients_per_round?), got the unknown key 'federation.roundz' in the config"),
    # Files.
    "binary config": (
        ["--config", "{tmp}/binary.yaml"], "config",
        "error: config: expected a YAML text file, got '{tmp}/binary.yaml (binary, not UTF-8 text)'"),
    "empty config": (
        ["--config", "{tmp}/empty.yaml"], "config",
        "error: config: expected a YAML mapping of settings (e.g. `federation: {rounds: 10}`), "
        "got '{tmp}/empty.yaml (empty)'"),
    "config that is not YAML": (
        ["--config", "{tmp}/broken.yaml"], "config",
        "error: config: expected a valid YAML file, got \"{tmp}/broken.yaml (expected the node content, but found "
        "'<stream end>' at line 2)\""),
    "config that does not exist": (
        ["--config", "{tmp}/absent.yaml"], "config", "error: config: expected an existing YAML file, "
        "got '{tmp}/absent.yaml'"),
    "config without a file name": (
        ["--config"], "config", "error: config: expected a value after --config, got nothing"),
    "resume from a missing checkpoint": (
        ["--resume", "{tmp}/absent.ckpt"], "resume",
        "error: resume: expected an existing checkpoint file, 'auto' or null, got '{tmp}/absent.ckpt'"),
    "out_dir under a file": (
        ["--out_dir", "{tmp}/a_file/run"], "out_dir",
        "error: out_dir: expected a folder that can be created and written, got '{tmp}/a_file/run (Not a "
        "directory)'"),
    "dataset not on disk": (
        ["--data.name", "cifar10", "--data.root", "{tmp}/nowhere"], "data.root",
        "error: data.root: expected {tmp}/nowhere/cifar-10-batches-py/ to hold data_batch_1..5 and test_batch "
        "(CIFAR-10, python version) (or set data.download: true), got '{tmp}/nowhere'"),
    "CIFAR-10 with a batch missing": (
        ["--data.name", "cifar10", "--data.root", "{tmp}/cifar_missing"], "data.root",
        "error: data.root: expected {tmp}/cifar_missing/cifar-10-batches-py/ to hold data_batch_1..5 and "
        "test_batch (CIFAR-10, python version), got '{tmp}/cifar_missing, whose cifar-10-batches-py/ lacks "
        "data_batch_3'"),
    "CIFAR-10 with a corrupt batch": (
        ["--data.name", "cifar10", "--data.root", "{tmp}/cifar_corrupt"], "data.root",
        "error: data.root: expected data_batch_2 to be a CIFAR batch (a python pickle with data and labels), got "
        "\"{tmp}/cifar_corrupt/cifar-10-batches-py/data_batch_2, unreadable (UnpicklingError: invalid load key, "
        "'\\\\x00'.)\""),
    "download without a network": (
        ["--data.name", "cifar10", "--data.root", "{tmp}/data", "--data.download", "true"], "data.download",
        f"error: data.download: expected a network connection to download {CIFAR10_URL} into {{tmp}}/data (or the "
        "dataset already there), got 'URLError: <urlopen error no network>'"),
    "two nodes outside SLURM": (
        ["--fabric.num_nodes", "2"], "fabric.num_nodes",
        "error: fabric.num_nodes: expected 1 outside SLURM (or every node started with MASTER_ADDR, MASTER_PORT and "
        "NODE_RANK set), got 2"),
    "resume from a file that is not a checkpoint": (
        ["--resume", "{tmp}/garbage.ckpt"], "resume", "error: resume: expected a checkpoint written by fl-lightning "
        "that passes its checks, got 'checkpoint {tmp}/garbage.ckpt is unreadable (...)'"),
    "CTP-FL with local_epochs on clients of unequal sizes": (
        ["--algorithm", "ctpfl", "--federation.local_steps", "null", "--federation.local_epochs", "1"],
        "federation.local_epochs",
        "error: federation.local_epochs: expected null for CTP-FL on these clients, whose sizes give from 1 to 6 "
        "local steps while CTP-FL's clients share one set of K query points (set federation.local_steps: K), got 1"),
    "fresh start over a folder holding a run": (
        ["--out_dir", "{tmp}/used_run", "--resume", "null"], "resume",
        "error: resume: expected 'auto' to continue the run already in {tmp}/used_run, overwrite: true to replace "
        "it, or another out_dir, got None"),
    "overwrite while resuming from a checkpoint": (
        ["--overwrite", "true", "--resume", "{tmp}/garbage.ckpt"], "overwrite",
        "error: overwrite: expected false when resume names a checkpoint (overwrite starts the run in out_dir "
        "afresh; resuming from a checkpoint continues one), got True"),
    "unknown client path": (
        ["--compute.client_path", "fast"], "compute.client_path",
        "error: compute.client_path: expected one of auto, loop, grouped, got 'fast'"),
    "zero group size": (
        ["--compute.group_size", "0"], "compute.group_size",
        "error: compute.group_size: expected an integer > 0 or null, got '0'"),
}


WORDED_ELSEWHERE = {
    "batch larger than every client", "constraint on an algorithm without local training",
    "requeue signal not a signal", "resume from a missing checkpoint", "out_dir under a file", "unknown model",
    "misspelt algorithm setting", "setting of an algorithm not chosen", "two nodes outside SLURM",
    "resume from a file that is not a checkpoint", "CTP-FL with local_epochs on clients of unequal sizes",
    "fresh start over a folder holding a run", "overwrite while resuming from a checkpoint",
}


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


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_error_line_before_training(case, tmp_path, capsys, request, offline_cpu_machine):
    arguments, field, user_sees = BAD_INPUTS[case]
    for name, write in FILES.items():
        if any(f"{{tmp}}/{name}" in argument for argument in arguments):
            write(tmp_path, lambda: request.getfixturevalue("cifar_root"))
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path / "run"), *arguments])

    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {field}: expected ") and ", got " in err
    if case not in WORDED_ELSEWHERE:
        assert err.splitlines() == [user_sees.replace("{tmp}", str(tmp_path))]
    assert "Traceback" not in out + err
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_reliability_page_lists_every_bad_input():
    page = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    missing = [case for case in BAD_INPUTS if f"| {case} |" not in page]
    assert not missing, f"docs/reliability.md lacks {missing}"


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
