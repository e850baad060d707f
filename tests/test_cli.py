"""The command line: the config hub, overrides, short names, help, and bad input caught before training."""

from pathlib import Path

import pytest
import yaml

from fl_lightning.algorithms import SHORT_NAMES, CTPFL, FedAvg
from fl_lightning.cli import build_parser, expand_short_names, main

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")


def parse(*argv):
    parser = build_parser()
    return parser.instantiate_classes(parser.parse_args(expand_short_names(["fit", *argv]))).fit


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_parses(config):
    arguments = parse("--config", str(config))
    assert arguments.algorithm.short_name in SHORT_NAMES


def test_dotted_fields_override_the_config():
    arguments = parse(
        "--config", QUICKSTART, "--seed", "7", "--out_dir", "elsewhere", "--fabric.accelerator", "cpu",
        "--fabric.devices", "2", "--fabric.num_nodes", "1", "--fabric.precision", "bf16-mixed",
        "--federation.rounds", "3", "--federation.num_clients", "8", "--federation.clients_per_round", "4",
        "--federation.local_steps", "5", "--federation.batch_size", "16", "--federation.eval_every", "2",
        "--data.root", "/somewhere",
    )
    assert arguments.seed == 7 and str(arguments.out_dir) == "elsewhere"
    assert (arguments.fabric.devices, arguments.fabric.precision) == (2, "bf16-mixed")
    federation = arguments.federation
    assert (federation.rounds, federation.num_clients, federation.clients_per_round) == (3, 8, 4)
    assert (federation.local_steps, federation.batch_size, federation.eval_every) == (5, 16, 2)
    assert str(arguments.data.root) == "/somewhere"


def test_algorithm_by_short_name_class_name_and_class_path():
    assert isinstance(parse("--config", QUICKSTART, "--algorithm", "fedavg").algorithm, FedAvg)
    chosen = parse("--config", QUICKSTART, "--algorithm", "ctpfl", "--algorithm.span", "0.25").algorithm
    assert isinstance(chosen, CTPFL) and chosen.span == 0.25
    assert isinstance(parse("--config", QUICKSTART, "--algorithm", "CTPFL").algorithm, CTPFL)
    assert isinstance(parse("--config", QUICKSTART, "--algorithm=fl_lightning.algorithms.CTPFL").algorithm, CTPFL)


def test_help_documents_every_group(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in ("--federation.local_epochs", "--data.alpha", "--fabric.devices", "--checkpoint.every",
                 "--logger.wandb_mode", "--client_optimizer.momentum", "--server_optimizer", "--resume"):
        assert name in text
    assert "Passes over each client's data per round" in text


def test_print_config_round_trips(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--algorithm", "ctpfl", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["class_path"].endswith("CTPFL")
    assert printed["federation"]["num_clients"] == 10


def test_written_config_reads_back(tmp_path, capsys):
    out_dir = tmp_path / "run"
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.progress_bar", "false",
          "--out_dir", str(out_dir), "--algorithm", "ctpfl", "--algorithm.span", "0.1"])
    again = parse("--config", str(out_dir / "config.yaml"))
    assert isinstance(again.algorithm, CTPFL) and again.algorithm.span == 0.1
    assert again.federation.rounds == 1 and str(again.out_dir) == str(out_dir)


BAD_INPUT = {
    "unknown algorithm": (["--algorithm", "fedfoo"], "algorithm"),
    "unknown model": (["--model.name", "no_such_net"], "model.name"),
    "alpha zero": (["--data.alpha", "0"], "data.alpha"),
    "alpha negative": (["--data.alpha", "-1"], "data.alpha"),
    "too many clients per round": (["--federation.clients_per_round", "11"], "federation.clients_per_round"),
    "no clients per round": (["--federation.clients_per_round", "0"], "federation.clients_per_round"),
    "both budgets": (["--federation.local_epochs", "1"], "federation.local_steps / federation.local_epochs"),
    "no budget": (["--federation.local_steps", "null"], "federation.local_steps / federation.local_epochs"),
    "missing dataset": (["--data.name", "cifar10", "--data.root", "/nonexistent/cifar"], "data.root"),
}


@pytest.mark.parametrize("overrides, field", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_fails_before_training_naming_the_field(tmp_path, capsys, overrides, field):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path / "run"), *overrides])
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
