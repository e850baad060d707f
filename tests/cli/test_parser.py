"""The command line: overrides, short names and help. The shipped configs are tested in
tests/integration/test_configs.py, bad input in tests/integration/test_bad_inputs.py."""

import re
from argparse import ArgumentError

import pytest
import yaml
from paths import CONFIGS, QUICKSTART

from fl_lightning.algorithms import CTPFL, SHORT_NAMES, FedAvg
from fl_lightning.cli.arguments import expand_bare_flags, expand_short_names
from fl_lightning.cli.parser import build_parser, parse_command_line
from fl_lightning.commands.main import COMMANDS, command_parser, main
from fl_lightning.experiments.sweeps.data_check import fit_line_of
from fl_lightning.models import registered_models
from fl_lightning.run_logging import MetricsLog


def parse(*argv):
    parser = build_parser()
    return parser.instantiate(parser.parse_args(expand_short_names(["fit", *argv]))).fit


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


def test_one_parser_parses_each_command_line_as_a_parser_of_its_own(capsys):
    """`main` parses with one parser per process (command_parser): what it parsed before, a refused
    input and a --print_config leave nothing behind in it."""
    command_lines = [
        ["fit", "--config", QUICKSTART, "--algorithm", "fedprox", "--algorithm.mu", "0.3", "--seed", "4"],
        ["fit", "--config", QUICKSTART, "--algorithm", "ctpfl", "--federation.rounds", "2", "--data.alpha", "0.1"],
        ["fit", "--config", QUICKSTART],
        ["sweep", "--plan", "plan.yaml", "--jobs", "2", "--override+", "federation.rounds=1"],
        ["table", "--plan", "plan.yaml", "--metric", "test_loss", "--at", "best"],
    ]
    fresh = [parse_command_line(argv, build_parser(COMMANDS)) for argv in command_lines]
    for argv in (["fit", "--config", QUICKSTART, "--federation.rounds", "-1"],
                 ["fit", "--config", QUICKSTART, "--algorithm", "scaffold", "--print_config"]):
        with pytest.raises(SystemExit):
            main(argv)
    capsys.readouterr()
    for argv, expected in [*zip(command_lines, fresh), *reversed(list(zip(command_lines, fresh)))]:
        assert parse_command_line(argv, command_parser()) == expected, argv


def test_a_line_that_starts_with_its_command_parses_as_the_whole_parser_parses_it():
    """parse_command_line parses such a line with its command's parser alone, which is faster: the
    settings must be those of the whole parser, with config files, short names, bare flags, lists of
    classes and JSON values in the line."""
    parser = command_parser()
    callbacks = '[{"class_path": "fl_lightning.callbacks.EarlyStopping", "init_args": {"patience": 2}}]'
    command_lines = [
        ["fit", "--config", QUICKSTART, "--algorithm", "fedprox", "--algorithm.mu", "0.3", "--seed", "4"],
        ["fit", "--config", QUICKSTART, "--config", str(CONFIGS / "const.yaml"), "--algorithm", "scaffold",
         "--model.options", "{hidden: 16, depth: 2}", "--callbacks", callbacks, "--data.alpha", "0.1"],
        ["fit", "--config", QUICKSTART, "--algorithm=ctpfl", "--federation.rounds=2", "--logger.progress_bar"],
        ["sweep", "--plan", "plan.yaml", "--jobs", "2", "--override+", "federation.rounds=1", "--dry_run"],
        ["table", "--plan", "plan.yaml", "--metric", "test_loss", "--at", "best"],
    ]
    for argv in command_lines:
        whole = parser.parse_args(expand_bare_flags(expand_short_names(argv), parser.commands))
        assert parse_command_line(argv, parser) == whole, argv


def test_help_documents_every_group(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in ("--federation.local_epochs", "--data.alpha", "--fabric.devices", "--checkpoint.every",
                 "--logger.wandb_mode", "--client_optimizer.momentum", "--server_optimizer", "--resume"):
        assert name in text
    assert "Passes over each client's data per round" in text


def help_entries(text: str) -> dict[str, str]:
    """Option -> its description in argparse help, with jsonargparse's `(type: ..., default: ...)` removed."""
    entries: dict[str, str] = {}
    option = None
    for line in text.splitlines():
        start = re.match(r"^  (-[^ ].*?)(?: {2,}(.*))?$", line)
        if start:
            option = start.group(1).split()[0].rstrip(",")
            entries[option] = start.group(2) or ""
        elif option is not None and line.startswith("   "):
            entries[option] += " " + line.strip()
        else:
            option = None
    jsonargparse_suffix = r"\((required, )?(type|default):.*$"
    return {option: re.sub(jsonargparse_suffix, "", words).strip() for option, words in entries.items()}


def test_help_describes_every_option_and_lists_algorithms_and_models(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = capsys.readouterr().out
    entries = help_entries(text)
    assert len(entries) > 40 and "--federation.rounds" in entries and "--fabric.precision" in entries
    assert [option for option, description in entries.items() if not description] == []
    listed = " ".join(text.split())
    assert all(name in listed for name in SHORT_NAMES) and all(name in listed for name in registered_models())


def test_every_sweep_option_is_described_and_the_old_mode_flags_name_their_mode(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    entries = help_entries(capsys.readouterr().out)
    assert [option for option, description in entries.items() if not description] == []
    assert [entries[flag] for flag in ("--list", "--estimate", "--slurm", "--fit_config")] == [
        "an alias of --mode list.", "an alias of --mode estimate.", "an alias of --mode submit.",
        "an alias of --mode fit_config."]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_sends_users_to_the_docs_never_to_source_files(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert re.findall(r"[\w/]+\.py\b", capsys.readouterr().out) == []


@pytest.mark.parametrize("argv", [["--algorithm.help", "scaffold"], ["--algorithm.help=fedprox"],
                                  ["--algorithm.help", "CTPFL"]])
def test_algorithm_help_takes_a_short_name(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *argv])
    assert exit_info.value.code == 0
    name = argv[-1].split("=")[-1]
    class_path = ".".join([SHORT_NAMES[name].__module__, SHORT_NAMES[name].__qualname__]) if name in SHORT_NAMES \
        else "CTPFL"
    assert class_path in capsys.readouterr().out


def test_expand_short_names_leaves_other_values_alone():
    assert expand_short_names(["fit", "--algorithm.help", "moon", "--logger.name", "fedavg", "--algorithm=fedcm",
                               "--algorithm", "SCAFFOLD"]) == [
        "fit", "--algorithm.help", "fl_lightning.algorithms.moon.MOON", "--logger.name", "fedavg",
        "--algorithm={class_path: fl_lightning.algorithms.fedcm.FedCM}",
        "--algorithm", "{class_path: fl_lightning.algorithms.scaffold.SCAFFOLD}",
    ]


def test_an_algorithm_chosen_on_the_command_line_starts_from_its_own_defaults(tmp_path):
    """The algorithm a config chose keeps none of its hyper-parameters when another is named after it."""
    fedcm = tmp_path / "fedcm.yaml"
    fedcm.write_text("algorithm: {class_path: fedcm, init_args: {alpha: 0.3}}\n")
    chosen = parse("--config", QUICKSTART, "--config", str(fedcm), "--algorithm", "feddyn").algorithm
    assert type(chosen).__name__ == "FedDyn" and chosen.init_args == {"alpha": 0.01}
    tuned = parse("--config", QUICKSTART, "--algorithm", "fedprox", "--algorithm.mu", "0.2").algorithm
    assert tuned.init_args == {"mu": 0.2}


def test_abbreviated_options_are_refused():
    # argparse would read --federation.round as --federation.rounds (its only completion).
    with pytest.raises(ArgumentError, match="federation.round"):
        build_parser().parse_args(["fit", "--config", QUICKSTART, "--federation.round", "5"])
    with pytest.raises(ArgumentError, match="unrecognized arguments: --se 5"):
        build_parser().parse_args(["fit", "--config", QUICKSTART, "--se", "5"])
    assert parse("--config", QUICKSTART, "--federation.rounds", "5").federation.rounds == 5


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--federation.roundz", "5"], "error: federation.roundz: expected a known setting (did you mean "
         "federation.rounds?), got the unknown key '--federation.roundz'"),
        (["--client_optimizer.learning_rate", "0.1"], "error: client_optimizer.learning_rate: expected a known "
         "setting (did you mean client_optimizer.lr or client_optimizer.weight_decay?), got the unknown key "
         "'--client_optimizer.learning_rate'"),
        (["--fed.rounds", "3"], "error: fed.rounds: expected a known setting (did you mean federation.rounds?), "
         "got the unknown key '--fed.rounds'"),
    ],
)
def test_unknown_key_suggests_the_closest_names_in_one_line(tmp_path, capsys, argv, line):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_unknown_algorithm_setting_suggests_that_algorithms_settings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--out_dir", str(tmp_path), "--algorithm", "ctpfl",
              "--algorithm.spam", "1"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: algorithm.spam: expected a known setting (did you mean algorithm.span")
    assert line.endswith("got the unknown key '--algorithm.spam'")


def test_unknown_key_in_a_yaml_config_suggests_the_closest_names(tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("federation:\n  roundz: 5\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--config", str(config), "--out_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: federation.roundz: expected a known setting (did you mean federation.rounds?), "
        "got the unknown key 'federation.roundz' in the config"]


def test_print_config_round_trips(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--algorithm", "ctpfl", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["class_path"].endswith("CTPFL")
    assert printed["federation"]["num_clients"] == 10


@pytest.mark.slow
def test_written_config_reads_back(tmp_path, capsys):
    out_dir = tmp_path / "run"
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.progress_bar", "false",
          "--out_dir", str(out_dir), "--algorithm", "ctpfl", "--algorithm.span", "0.1"])
    again = parse("--config", str(out_dir / "config.yaml"))
    assert isinstance(again.algorithm, CTPFL) and again.algorithm.span == 0.1
    assert again.federation.rounds == 1 and str(again.out_dir) == str(out_dir)


def test_model_help_lists_a_models_options(capsys):
    main(["fit", "--model.help", "mlp"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("registered model mlp; keys of model.options")
    assert printed[1:3] == ["  hidden (default 200)", "  depth (default 2)"]
    main(["fit", "--model.help=resnet18"])
    assert "(none)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.help", "no_such_network"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: model.name: expected one of linear, mlp")


def test_an_on_off_setting_given_alone_means_true():
    assert expand_bare_flags(["sweep", "--plan", "p.yaml", "--list", "--jobs", "2", "--dry_run"], COMMANDS) == [
        "sweep", "--plan", "p.yaml", "--list=true", "--jobs", "2", "--dry_run=true"]
    assert expand_bare_flags(["fit", "--data.augment", "--overwrite", "false", "--compute.compile"], COMMANDS) == [
        "fit", "--data.augment=true", "--overwrite", "false", "--compute.compile=true"]
    # Only the command's own flags: `table` has no --list, and --metric takes a value.
    assert expand_bare_flags(["table", "--list", "--metric", "--percent"], COMMANDS) == ["table", "--list", "--metric",
                                                                                "--percent=true"]


def test_sweep_lists_with_a_bare_flag(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"name: demo\nconfigs: [{QUICKSTART}]\nmethods: {{FedAvg: [{{algorithm: fedavg}}]}}\n")
    main(["sweep", str(plan), "--runs_root", str(tmp_path / "runs"), "--list"])
    assert "not started" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_sweep_and_table_take_the_plan_as_their_first_argument(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"name: demo\nconfigs: [{QUICKSTART}]\nmethods: {{FedAvg: [{{algorithm: fedavg}}]}}\n"
                    "seeds: [0, 1]\n")
    main(["sweep", str(plan), "--list", "true", "--runs_root", str(tmp_path / "runs")])
    listed = capsys.readouterr().out
    assert "fedavg" in listed and "seed1" in listed and "not started" in listed


def test_compare_takes_run_folders_one_after_another_or_with_runs_repeated(tmp_path, capsys):
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
        MetricsLog(tmp_path / name, history=[]).append({"round": 1, "test_accuracy": 0.5})
    folders = [str(tmp_path / name) for name in ("a", "b", "c", "d")]
    # As a shell expands `--runs runs/*`, each folder once, and every form of --runs besides.
    for argv in (["--runs", *folders], ["--runs", *folders[:2], "--metric", "test_accuracy", "--runs", *folders[2:]],
                 [f"--runs={folders[0]}", "--runs", f"[{folders[1]}, {folders[2]}]", "--runs", folders[3]]):
        main(["compare", *argv])
        assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:5]] == folders, argv
    main(["compare", "--runs", str(tmp_path / "*")])  # one pattern stays one value
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:5]] == folders


def test_data_takes_plans_or_a_fit_command_line():
    fit_line = ["--config", QUICKSTART, "--data.root", "/scratch/data", "--data.download"]
    assert fit_line_of(["data", *fit_line]) == fit_line
    for argv in (["data", "plan.yaml"], ["data", "a.yaml", "b.yaml", "--override", "data.download=true"],
                 ["data", "--plan", "plan.yaml"], ["data", "--plan=plan.yaml"], ["data", "--help"], ["data"],
                 ["sweep", "--config", QUICKSTART], ["fit", "--config", QUICKSTART]):
        assert fit_line_of(argv) is None, argv
    assert "data" in COMMANDS


@pytest.mark.slow
def test_help_and_a_refused_config_never_import_lightning(tmp_path):
    """Lightning, most of what start-up cost (docs/performance.md), is imported when a run launches,
    not to parse or refuse one: checked in a fresh interpreter."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from fl_lightning.commands.main import main\n"
        "for argv in (['fit', '--help'], ['fit', '--config', sys.argv[1], '--out_dir', sys.argv[2],\n"
        "                                 '--federation.clients_per_round', '1000']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exited:\n"
        "        print('exit', exited.code)\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('lightning', 'torchmetrics')))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script, QUICKSTART, str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=300)
    assert completed.stdout.splitlines()[-3:] == ["exit 0", "exit 2", "[]"], completed.stderr
    assert "error: federation.clients_per_round: expected an integer from 1 to" in completed.stderr


@pytest.mark.parametrize("algorithm, marked", [("ctpfl", True), ("fedavg", False)])
def test_print_config_marks_the_client_optimizer_of_an_algorithm_that_trains_no_local_model(algorithm, marked,
                                                                                            capsys, tmp_path):
    """CTP-FL's clients train no local model: its run records client_optimizer and never reads it. The
    printed config says so in a comment, and still reads back as it is."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--algorithm", algorithm, "--client_optimizer.lr", "0.3",
              "--print_config"])
    printed = capsys.readouterr().out
    comment = "# client_optimizer: not read by this run (the clients of CTPFL train no local model)\nclient_optimizer:"
    assert (comment in printed) == marked and "\nclient_optimizer:\n  lr: 0.3\n" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert parse("--config", str(tmp_path / "printed.yaml")).client_optimizer.lr == 0.3
