"""A user's own algorithm, model and dataset, each a module named by its dotted path: the commands
of docs/extending.md run end to end on the examples/ files (in-process, a few tiny rounds), and
every way of getting the names or the returned objects wrong is one error naming the field."""

import json
import math
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from paths import EXAMPLES, QUICKSTART, REPOSITORY
from torch import nn

from fl_lightning.algorithms import SHORT_NAMES, FedAvg
from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.commands.main import main
from fl_lightning.config import DataArgs, ModelArgs
from fl_lightning.data import DATASET_NAMES, load_dataset
from fl_lightning.errors import ConfigError
from fl_lightning.federation.aggregation import UploadBuffer
from fl_lightning.models import create_model
from fl_lightning.models.registry import check_model_settings
from fl_lightning.server_optimizers import ServerSGD, ServerState

DOC = REPOSITORY / "docs" / "extending.md"
EXAMPLE_MODULES = ("my_algorithm", "my_server_rule", "my_model", "my_dataset", "my_callback", "bad_extensions")
# Appended to the documented commands: later settings override earlier ones.
TINY = ["--federation.rounds", "2", "--federation.num_clients", "4", "--federation.clients_per_round", "2",
        "--federation.local_steps", "2", "--federation.eval_every", "1", "--checkpoint.every", "1",
        "--logger.progress_bar", "false"]

# A module of mistakes, written next to each test that needs it.
BAD_EXTENSIONS = '''
import torch
from torch import nn
from fl_lightning.data import ImageDataset

NOT_CALLABLE = 3


def sequential(num_classes, in_channels, image_size, norm, bias):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))


def not_a_module(num_classes, in_channels, image_size, norm, bias):
    return "a network"


def positional_only(num_classes, in_channels, image_size, norm, bias, /):
    return None


def split(images, labels, num_classes=2, mean=(0.5,), std=(0.25,)):
    return ImageDataset(images, labels, num_classes, mean, std)


GOOD = (torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.tensor([0, 1, 0, 1]))


def one_split(root, download):
    return split(*GOOD)


def float_images(root, download):
    return split(GOOD[0].float(), GOOD[1]), split(*GOOD)


def labels_beyond_classes(root, download):
    return split(GOOD[0], torch.tensor([0, 1, 2, 1])), split(*GOOD)


def statistics_for_three_channels(root, download):
    return split(*GOOD, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)), split(*GOOD)


def test_smaller_than_train(root, download):
    return split(*GOOD), split(torch.zeros(4, 1, 4, 4, dtype=torch.uint8), GOOD[1])


def positional_loader(path, fetch):
    return split(*GOOD), split(*GOOD)
'''


@pytest.fixture
def on_path(monkeypatch, tmp_path):
    """examples/ and a module of mistakes importable, as PYTHONPATH=examples makes them; afterwards
    the modules are forgotten, and the example algorithm's short name with them."""
    (tmp_path / "bad_extensions.py").write_text(BAD_EXTENSIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(REPOSITORY)  # the documented commands name files relative to the repository
    short_names = dict(SHORT_NAMES)
    yield
    SHORT_NAMES.clear()
    SHORT_NAMES.update(short_names)
    for name in EXAMPLE_MODULES:
        sys.modules.pop(name, None)


def documented_commands() -> list[list[str]]:
    """The arguments of every `PYTHONPATH=examples .venv/bin/fl-lightning ...` command in the doc."""
    text = DOC.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        words = shlex.split(block.replace("\\\n", " "))
        if words[:2] == ["PYTHONPATH=examples", ".venv/bin/fl-lightning"]:
            commands.append(words[2:])
    return commands


def run_fit(arguments: list[str], out_dir: Path) -> list[dict]:
    main([*arguments, *TINY, "--out_dir", str(out_dir)])
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def recorded(out_dir: Path) -> dict:
    return yaml.safe_load((out_dir / "config.yaml").read_text())


def error_line(arguments: list[str], out_dir: Path, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(out_dir), *arguments])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (out_dir / "metrics.jsonl").exists()
    return err.splitlines()[-1]


def test_the_doc_shows_each_example_once_and_runs_it():
    commands = [" ".join(command) for command in documented_commands()]
    assert len(commands) == 6
    for name in ("--algorithm my_algorithm.ClippedFedAvg", "--algorithm my_server_rule.FedExP",
                 "--model.name my_model.make_net",
                 "--data.name my_dataset.load_shapes", "--config examples/extending.yaml",
                 "--config examples/callback.yaml"):
        assert sum(name in command for command in commands) == 1, name


def test_the_doc_quotes_the_example_files_as_they_are():
    """Each block is a piece of an example file; one that shows imports shows all of its file's, so
    that it runs as shown."""
    sources = {path: path.read_text() for path in EXAMPLES.glob("*.py")}
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 6
    for block in blocks:
        (source,) = [text for text in sources.values() if block in text] or [None]
        assert source is not None, block.splitlines()[0]
        if import_lines(block):
            assert import_lines(block) == import_lines(source), block.splitlines()[0]


def import_lines(source: str) -> list[str]:
    return [line for line in source.splitlines() if re.match(r"(from \S+ )?import ", line)]


@pytest.mark.parametrize("command", documented_commands(), ids=lambda command: command[-1].split("/")[-1])
def test_documented_command_trains(command, tmp_path, on_path):
    rows = run_fit(command, tmp_path / "run")

    assert [row["round"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["train_loss"]) and 0 <= row["test_accuracy"] <= 1 for row in rows)
    config = recorded(tmp_path / "run")
    for option, value in zip(command, command[1:]):  # the dotted names are what the run recorded
        if option == "--algorithm":
            assert config["algorithm"]["class_path"] == value
        elif option in ("--model.name", "--data.name"):
            assert config[option[2:].split(".")[0]]["name"] == value


def test_user_callback_stops_the_run_and_records_its_metric(tmp_path, on_path):
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("callbacks: [{class_path: my_callback.StopAtAccuracy, init_args: {target: 0.3}}]\n")
    main(["fit", "--config", QUICKSTART, "--config", str(callbacks), "--federation.rounds", "20",
          "--federation.eval_every", "1", "--logger.progress_bar", "false", "--out_dir", str(tmp_path / "run")])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reached = [row["round"] for row in rows if "reached_target_at" in row]
    assert reached and rows[reached[0] - 1]["test_accuracy"] >= 0.3
    assert all(row["test_accuracy"] < 0.3 for row in rows[:reached[0] - 1])
    assert rows[-1]["round"] == reached[0] + 1 < 20  # asked at the end of a round, agreed at the next
    assert recorded(tmp_path / "run")["callbacks"][0]["class_path"] == "my_callback.StopAtAccuracy"


@pytest.mark.slow
def test_user_callback_state_survives_a_resume(tmp_path, on_path):
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("callbacks: [{class_path: my_callback.CountEvaluations}]\n")
    arguments = ["fit", "--config", QUICKSTART, "--config", str(callbacks), "--federation.eval_every", "1",
                 "--logger.progress_bar", "false", "--out_dir", str(tmp_path / "run")]
    main([*arguments, "--federation.rounds", "2"])
    main([*arguments, "--federation.rounds", "4"])  # a new process's callback, given the saved count
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["evaluations"] for row in rows] == [1, 2, 3, 4]


def test_user_algorithm_clips_uploads_and_resumes(tmp_path, on_path):
    out_dir = tmp_path / "run"
    arguments = ["fit", "--config", QUICKSTART, "--algorithm", "my_algorithm.ClippedFedAvg",
                 "--algorithm.clip_norm", "0.05"]
    rows = run_fit(arguments, out_dir)
    # Uniform weights average vectors of norm <= clip_norm; the server's SGD (lr 1) steps by that.
    assert all(0 < row["update_norm"] <= 0.05 + 1e-6 for row in rows)
    assert recorded(out_dir)["algorithm"] == {"class_path": "my_algorithm.ClippedFedAvg",
                                              "init_args": {"clip_norm": 0.05}}

    # A resume reads the class path back from the run's config and checkpoint.
    main([*arguments, *TINY, "--federation.rounds", "3", "--out_dir", str(out_dir)])
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2, 3]


def test_a_variant_of_a_built_in_algorithm_neither_takes_its_short_name_nor_its_runs_name():
    class SlowerFedAvg(FedAvg):
        pass

    assert SHORT_NAMES["fedavg"] is FedAvg
    assert (FedAvg.method_name(), SlowerFedAvg.method_name()) == ("fedavg", "SlowerFedAvg")


def test_user_algorithm_runs_grouped_as_it_runs_client_by_client(tmp_path, on_path):
    """The client rule, written once, also runs under vmap in the grouped path."""
    arguments = ["fit", "--config", QUICKSTART, "--algorithm", "my_algorithm.ClippedFedAvg",
                 "--algorithm.clip_norm", "0.05"]
    loop = run_fit([*arguments, "--compute.client_path", "loop"], tmp_path / "loop")
    grouped = run_fit([*arguments, "--compute.client_path", "grouped"], tmp_path / "grouped")
    for name in ("train_loss", "update_norm", "test_accuracy"):
        assert [row[name] for row in grouped] == pytest.approx([row[name] for row in loop], rel=1e-5, abs=1e-7)


def test_user_server_rule_steps_by_the_extrapolation_of_its_clients_numbers(on_path):
    """FedExP's squared norms ride the all-reduce as one element each; the server's step against a direct
    computation from the clients' changes."""
    from my_server_rule import SQUARED_NORM, FedExP

    algorithm, generator = FedExP(epsilon=1e-3), torch.Generator().manual_seed(0)
    changes = [torch.randn(5, generator=generator, dtype=torch.float64) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    buffer = UploadBuffer(algorithm, num_params=5, num_buffers=0, device=torch.device("cpu"))
    assert buffer.flat.numel() == UploadBuffer(FedAvg(), 5, 0, torch.device("cpu")).flat.numel() + 1
    for change, weight in zip(changes, weights):
        buffer.add({PSEUDO_GRADIENT: change.float(), SQUARED_NORM: change.float().square().sum().reshape(1)}, weight)
    aggregate = buffer.reduced(SimpleNamespace(world_size=1))
    params, state = torch.zeros(5), ServerState(ServerSGD(lr=1.0), num_clients=3)
    algorithm.server_update(state, params, aggregate)

    mean_change = sum(w * c for w, c in zip(weights, changes))
    mean_square = sum(w * float(c @ c) for w, c in zip(weights, changes))
    eta = max(1.0, mean_square / (2 * (float(mean_change @ mean_change) + 1e-3)))
    assert eta > 1  # extrapolated: the clients disagree
    torch.testing.assert_close(params, (-eta * mean_change).float())


def test_user_server_rule_sends_its_number_at_its_size(tmp_path, on_path):
    arguments = ["fit", "--config", QUICKSTART, "--model.options", "{hidden: 16}"]
    fedexp = run_fit([*arguments, "--algorithm", "my_server_rule.FedExP"], tmp_path / "fedexp")
    fedavg = run_fit([*arguments, "--algorithm", "fedavg"], tmp_path / "fedavg")
    assert all(row["server_lr"] >= 1 for row in fedexp)
    reported = sum(row["clients_reported"] for row in fedexp)
    assert fedexp[-1]["cost_upload_bytes"] == fedavg[-1]["cost_upload_bytes"] + 4 * reported
    assert fedexp[-1]["cost_download_bytes"] == fedavg[-1]["cost_download_bytes"]


def test_user_model_follows_the_interface(on_path):
    model = create_model("my_model.make_net", num_classes=4, in_channels=3, image_size=16, norm="gn", bias=False,
                         width=4)
    images = torch.randn(2, 3, 16, 16)
    features = model.forward_features(images)
    assert features.shape == (2, model.feature_dim) == (2, 8)
    torch.testing.assert_close(model(images), model.classifier(features))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(m.bias is None for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


def test_user_dataset_is_what_a_loader_returns(on_path):
    train, test = load_dataset("my_dataset.load_shapes", Path("unused"))
    assert train.images.shape == (2000, 3, 16, 16) and test.images.shape == (500, 3, 16, 16)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.num_classes == test.num_classes == 4 and set(train.labels.tolist()) == {0, 1, 2, 3}


def test_help_lists_the_built_in_datasets_and_dotted_paths(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    data_name = help_text[help_text.index("--data.name NAME The dataset"):]
    data_name = data_name[:data_name.index("--data.root")]
    assert all(name in data_name for name in DATASET_NAMES) and "module.function" in data_name


# arguments -> the field named and words the line must hold
NAME_ERRORS = {
    "unknown plain dataset": (["--data.name", "mnist"], "data.name",
                              "one of cifar10, cifar100, tiny_imagenet, digits, got 'mnist'"),
    "dataset module not on the path": (["--data.name", "no_such_module.load"], "data.name", "PYTHONPATH"),
    "dataset loader not in its module": (["--data.name", "my_dataset.load_nothing"], "data.name",
                                         "has no attribute 'load_nothing'"),
    "dataset loader not callable": (["--data.name", "my_dataset.CLASSES"], "data.name", "of type tuple"),
    "dataset loader without root and download": (["--data.name", "bad_extensions.positional_loader"],
                                                 "data.name", "root and download"),
    "model module not on the path": (["--model.name", "no_such_module.make_net"], "model.name", "PYTHONPATH"),
    "model factory not in its module": (["--model.name", "my_model.make_nothing"], "model.name",
                                        "has no attribute 'make_nothing'"),
    "model factory not callable": (["--model.name", "bad_extensions.NOT_CALLABLE"], "model.name", "of type int"),
    "model factory without the arguments": (["--model.name", "my_dataset.load_shapes"], "model.name",
                                            "num_classes, in_channels, image_size, norm, bias"),
    "model factory taking them positionally only": (["--model.name", "bad_extensions.positional_only"],
                                                    "model.name", "num_classes"),
    "model option the factory lacks": (["--model.name", "my_model.make_net", "--model.options", "{depth: 2}"],
                                       "model.options", "keys among width"),
    "algorithm module not on the path": (["--algorithm", "no_such_module.Algorithm"], "algorithm",
                                         "an Algorithm subclass"),
    "algorithm not an Algorithm": (["--algorithm", "my_model.SmallCNN"], "algorithm", "an Algorithm subclass"),
    "algorithm setting out of range": (["--algorithm", "my_algorithm.ClippedFedAvg", "--algorithm.clip_norm", "0"],
                                       "algorithm.init_args.clip_norm", "a number > 0"),
}


@pytest.mark.parametrize("case", NAME_ERRORS)
def test_bad_name_is_one_line_before_a_run_folder(case, tmp_path, capsys, on_path):
    arguments, field, words = NAME_ERRORS[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path / "run"), *arguments])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {field}: expected ") and words in err
    assert not (tmp_path / "run").exists()


RETURN_ERRORS = {
    # The quickstart's MLP options are cleared: these factories take none.
    "model without forward_features": (["--model.name", "bad_extensions.sequential", "--model.options", "{}"],
                                       "model.name", "no forward_features, classifier of type NoneType"),
    "model not an nn.Module": (["--model.name", "bad_extensions.not_a_module", "--model.options", "{}"],
                               "model.name", "returned a value of type str"),
    "one split instead of two": (["--data.name", "bad_extensions.one_split"], "data.name",
                                 "returned a value of type ImageDataset"),
    "float images": (["--data.name", "bad_extensions.float_images"], "data.name", "torch.float32"),
    "labels beyond num_classes": (["--data.name", "bad_extensions.labels_beyond_classes"], "data.name",
                                  "labels from 0 to 2 for num_classes 2"),
    "statistics for other channels": (["--data.name", "bad_extensions.statistics_for_three_channels"],
                                      "data.name", "for 1 channel(s)"),
    "test images unlike train": (["--data.name", "bad_extensions.test_smaller_than_train"], "data.name",
                                 "test images (1, 4, 4)"),
}


@pytest.mark.parametrize("case", RETURN_ERRORS)
def test_wrong_return_type_names_the_field(case, tmp_path, capsys, on_path):
    arguments, field, words = RETURN_ERRORS[case]
    line = error_line(arguments, tmp_path / "run", capsys)
    assert line.startswith(f"error: {field}: expected ") and words in line


def test_settings_check_the_names_when_built(on_path):
    with pytest.raises(ConfigError) as caught:
        DataArgs(name="mnist")
    assert caught.value.field_name == "data.name" and all(name in str(caught.value) for name in DATASET_NAMES)
    with pytest.raises(ConfigError) as caught:
        ModelArgs(name="no_such_module.make_net")
    assert caught.value.field_name == "model.name"
    assert DataArgs(name="my_dataset.load_shapes").name == "my_dataset.load_shapes"
    assert ModelArgs(name="my_model.make_net", options={"width": 4}).options == {"width": 4}


def test_timm_names_with_a_dot_are_still_timm_models():
    check_model_settings("resnet10t.c3_in1k", {})  # a tag, not a module
    with pytest.raises(ConfigError, match="model.name"):
        check_model_settings("no_such_module.no_such_net", {})

