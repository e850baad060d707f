"""The config hub: every shipped composition of configs/ parses and trains one tiny round end to
end; no value is written in two fragments; an algorithm named in YAML (by short name too) starts
from its own defaults, so one method's settings never leak into another's.

A run is `fit --config <setting> --config algorithms/<name>.yaml [--config tuned/<setting>/<name>.yaml]
[--config const.yaml | const_authors_code.yaml | const_authors_strict.yaml]`; COMPOSITIONS lists the
shipped ones (README.md gives the same commands).
"""

import inspect
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pytest
import yaml
from paths import CONFIGS, QUICKSTART

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.cli.arguments import check_config_files
from fl_lightning.cli.parser import build_parser, parse_command_line
from fl_lightning.commands.main import main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import fit_parser

LOCAL_UPDATE = ("fedavg", "fedavg_server_momentum", "fedavg_client_momentum", "fedcm", "scaffold", "fedprox", "feddyn",
                "moon", "fedsam")
FEDCONST_TABLE_1 = ("fedavg", "fedprox", "moon", "scaffold", "feddyn", "fedsam")

# setting -> (algorithm, its CONST preset or None) pairs shipped with it.
COMPOSITIONS = {
    # FedCONST's Table 1: each method without CONST, with CONST as the paper writes it (const.yaml) and
    # as the authors' code runs it (const_authors_code.yaml); their later per-row variant with FedAvg.
    "cifar10_lenet5_fedconst": [(name, const) for name in FEDCONST_TABLE_1
                                for const in (None, "const", "const_authors_code")]
                               + [("fedavg", "const_authors_strict")],
    # CTP-FL against every local-update method at the same K = 50.
    "cifar10_lenet5_ctpfl": [("ctpfl", None)] + [(name, None) for name in LOCAL_UPDATE],
    "cifar100_resnet18_ctpfl": [("ctpfl", None)],
    "tinyimagenet_vit_tiny_ctpfl": [("ctpfl", None)],
    # The one-command demo (FedAvg), with any other algorithm instead.
    "quickstart": [(name, None) for name in sorted(SHORT_NAMES)],
}

# Values that two settings both write. A YAML file can take a whole group from a file
# (`federation: ../federation/ctpfl.yaml`) but not take one and change a field of it (with
# `federation.local_epochs: 5` beside it, jsonargparse drops the file), so settings whose groups
# differ in a field each write their group out.
COINCIDENCES = {
    # FedCONST's cross-device federation is the CTP-FL paper's, with 5 local epochs for K = 50 steps.
    ("federation.rounds", 300), ("federation.num_clients", 100), ("federation.clients_per_round", 10),
    ("federation.batch_size", 50), ("federation.eval_every", 5),
    # The CTP-FL paper splits CIFAR-100 and Tiny-ImageNet alike.
    ("data.alpha", 0.1),
    # Each CONST preset names the class; the authors' code's two presets share the rule's timing and
    # what that code trains with (biases, no weight decay).
    ("constraint.class_path", "fl_lightning.constraints.CONST"), ("constraint.init_args.constrained", "displacement"),
    ("constraint.init_args.when", "after_step"), ("model.bias", True), ("client_optimizer.weight_decay", 0.0),
}


def setting_file(setting: str) -> Path:
    return CONFIGS / "quickstart.yaml" if setting == "quickstart" else CONFIGS / "settings" / f"{setting}.yaml"


def composition(setting: str, algorithm: str, const: Optional[str]) -> list[Path]:
    files = [setting_file(setting), CONFIGS / "algorithms" / f"{algorithm}.yaml"]
    tuned = CONFIGS / "tuned" / setting / f"{algorithm}.yaml"
    if tuned.exists():
        files.append(tuned)
    if const is not None:
        files.append(CONFIGS / f"{const}.yaml")
    return files


SHIPPED = [(setting, algorithm, const) for setting, runs in COMPOSITIONS.items() for algorithm, const in runs]
IDS = [f"{setting}+{algorithm}" + (f"+{const}" if const else "") for setting, algorithm, const in SHIPPED]


def config_args(files: list[Path]) -> list[str]:
    return [arg for path in files for arg in ("--config", str(path))]


def parse(*argv: str):
    """The parsed (not instantiated) settings of `fit`: jsonargparse's own record of them, by fit's
    parser built once in this process, the one a sweep parses its grid points with."""
    return parse_command_line(["fit", *argv], fit_parser()).fit


def init_args(spec) -> dict:
    """A parsed class spec's init_args (jsonargparse leaves them out for a class that takes none)."""
    return dict(vars(spec.init_args)) if "init_args" in spec else {}


def class_defaults(cls: type) -> dict:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.default is not p.empty}


def written_init_args(files: list[Path]) -> dict:
    """The algorithm's init_args as the files write them, a later file over an earlier one."""
    written = {}
    for path in files:
        spec = (yaml.safe_load(path.read_text()) or {}).get("algorithm")
        if isinstance(spec, dict):
            written.update(spec.get("init_args") or {})
    return written


@pytest.mark.parametrize("setting, algorithm, const", SHIPPED, ids=IDS)
def test_every_shipped_composition_parses_with_only_its_own_algorithm_settings(setting, algorithm, const):
    files = composition(setting, algorithm, const)
    parsed = parse(*config_args(files))
    cls = SHORT_NAMES[algorithm]
    assert parsed.algorithm.class_path == f"{cls.__module__}.{cls.__qualname__}"
    # Exactly the class's defaults and what this composition's files write: nothing from the
    # quickstart's FedAvg or any other algorithm.
    assert init_args(parsed.algorithm) == {**class_defaults(cls), **written_init_args(files)}
    assert (parsed.constraint is not None) == (const is not None)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Small CIFAR-10, CIFAR-100 and Tiny-ImageNet folders in their real layouts, side by side. The test
    splits hold a few images: a round evaluates them all, and the bf16 settings' ResNet-18 and ViT-Tiny
    evaluate slowly on a CPU (the test checks that an evaluation is logged, not what it measures)."""
    from fl_lightning.data.generate import write_cifar, write_tiny_imagenet

    root = tmp_path_factory.mktemp("datasets")
    write_cifar(root, variant="cifar10", num_train=120, num_test=2, seed=0)
    write_cifar(root, variant="cifar100", num_train=120, num_test=2, seed=0)
    write_tiny_imagenet(root, num_classes=3, train_per_class=16, val_per_class=1, seed=0)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("setting, algorithm, const", SHIPPED, ids=IDS)
def test_every_shipped_composition_trains_one_round(setting, algorithm, const, data_root, tmp_path):
    files = composition(setting, algorithm, const)
    # Tiny sizes, as litgpt's config hub test shrinks its models; one local step or epoch, whichever
    # budget the setting uses: an epoch in batches of 8, a step of 2 images (the step settings train
    # ResNet-18 and ViT-Tiny, slow on a CPU). GPU settings run on this CPU in their own precision.
    by_epochs = parse(*config_args(files)).federation.local_epochs is not None
    budget, batch_size = ("local_epochs", "8") if by_epochs else ("local_steps", "2")
    out_dir = tmp_path / "run"
    main(["fit", *config_args(files),
          "--federation.rounds", "1", "--federation.num_clients", "4", "--federation.clients_per_round", "2",
          f"--federation.{budget}", "1", "--federation.batch_size", batch_size,
          "--data.root", str(data_root), "--data.min_samples", "2",
          "--fabric.accelerator", "cpu", "--fabric.devices", "1", "--fabric.num_nodes", "1",
          "--logger.wandb_mode", "disabled", "--logger.progress_bar", "false", "--out_dir", str(out_dir)])
    (record,) = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["round"] == 1 and math.isfinite(record["train_loss"]) and "test_accuracy" in record
    written = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert written["algorithm"]["class_path"].endswith(SHORT_NAMES[algorithm].__qualname__)
    assert (written["constraint"] is not None) == (const is not None)


# Folders of files that each hold one group of settings, named after the group.
GROUP_FOLDERS = ("federation", "data", "model", "fabric")


def fragments() -> list[Path]:
    """Every YAML file in configs/ but the quickstart, which is a whole run by design, and the sweep
    plans (configs/plans/), which compose fragments rather than being one."""
    return sorted(path for path in CONFIGS.rglob("*.yaml")
                  if path.name != "quickstart.yaml" and "plans" not in path.relative_to(CONFIGS).parts)


def flatten(value, prefix: str = "") -> dict:
    if not isinstance(value, dict):
        return {prefix: value}
    pairs = {}
    for key, item in value.items():
        pairs.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return pairs


def written_pairs(path: Path) -> dict:
    """(key, value) pairs a file writes, with its keys as `fit` sees them: a group file referenced by
    a setting (`federation: ../federation/ctpfl.yaml`) writes under that group; a reference itself
    writes nothing. Algorithms are compared by class, however named."""
    group = path.parent.name if path.parent.name in GROUP_FOLDERS else ""
    pairs = flatten(yaml.safe_load(path.read_text()), group)
    for key, value in list(pairs.items()):
        if isinstance(value, str) and value.endswith(".yaml"):
            assert (path.parent / value).is_file(), f"{path}: {key} names a missing file {value}"
            del pairs[key]
        elif key in ("algorithm", "algorithm.class_path") and value in SHORT_NAMES:
            pairs[key] = f"{SHORT_NAMES[value].__module__}.{SHORT_NAMES[value].__qualname__}"
    return {(key.replace("algorithm.class_path", "algorithm"), str(value)): value for key, value in pairs.items()}


def test_no_value_is_written_in_two_fragments():
    writers = defaultdict(list)
    for path in fragments():
        for pair in written_pairs(path):
            writers[pair].append(str(path.relative_to(CONFIGS)))
    repeated = {pair: files for pair, files in writers.items() if len(files) > 1}
    coincidences = {(key, str(value)) for key, value in COINCIDENCES}
    assert {pair: files for pair, files in repeated.items() if pair not in coincidences} == {}
    assert coincidences <= set(repeated), "a listed coincidence is no longer repeated: remove it from COINCIDENCES"


def test_every_fragment_is_part_of_a_shipped_composition():
    used = {path for setting, algorithm, const in SHIPPED for path in composition(setting, algorithm, const)}
    referenced = {(path.parent / value).resolve() for path in used
                  for value in flatten(yaml.safe_load(path.read_text())).values()
                  if isinstance(value, str) and value.endswith(".yaml")}
    unused = [str(path.relative_to(CONFIGS)) for path in fragments()
              if path not in used and path.resolve() not in referenced]
    assert unused == []


def test_settings_name_no_algorithm():
    # So that composing a setting with an algorithm never mixes two algorithms' settings.
    for path in (CONFIGS / "settings").glob("*.yaml"):
        assert "algorithm" not in yaml.safe_load(path.read_text()), path


# Short names in YAML, and what a later file naming another algorithm does.


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)




@pytest.mark.parametrize("text", [
    "algorithm: fedprox\n",
    "algorithm: FedProx\n",
    "algorithm: fl_lightning.algorithms.fedprox.FedProx\n",
    "algorithm:\n  class_path: fedprox\n",
    "algorithm: {class_path: fedprox, init_args: {mu: 0.3}}\n",
])
def test_yaml_names_an_algorithm_as_the_command_line_does(tmp_path, text):
    parsed = parse("--config", QUICKSTART, "--config", write(tmp_path, "algorithm.yaml", text))
    assert parsed.algorithm.class_path == "fl_lightning.algorithms.fedprox.FedProx"
    assert parsed.algorithm.init_args.mu == (0.3 if "0.3" in text else 0.01)


def test_a_config_given_before_the_command_names_an_algorithm_under_fit(tmp_path):
    config = write(tmp_path, "top.yaml", "fit:\n  algorithm: {class_path: moon, init_args: {tau: 0.2}}\n")
    setting = str(CONFIGS / "settings" / "cifar10_lenet5_ctpfl.yaml")
    parsed = build_parser().parse_args(["--config", config, "fit", "--config", setting]).fit
    assert parsed.algorithm.class_path.endswith("MOON")
    assert (parsed.algorithm.init_args.mu, parsed.algorithm.init_args.tau) == (5.0, 0.2)


def test_an_inline_algorithm_on_the_command_line_takes_a_short_name():
    parsed = parse("--config", QUICKSTART, "--algorithm", "{class_path: fedsam, init_args: {rho: 0.2}}")
    assert parsed.algorithm.class_path.endswith("FedSAM") and parsed.algorithm.init_args.rho == 0.2


def test_an_unknown_algorithm_in_yaml_is_refused_naming_the_field(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--config", write(tmp_path, "bad.yaml", "algorithm: fedprocs\n"),
              "--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: algorithm: expected an algorithm") and "fedprocs" in line


@pytest.mark.parametrize("first, second, field, expected", [
    # jsonargparse alone keeps FedProx's mu as MOON's mu, FedCM's alpha as FedDyn's alpha.
    ("algorithm: {class_path: fedprox, init_args: {mu: 0.3}}\n", "algorithm: moon\n", "mu", 5.0),
    ("algorithm: {class_path: fedcm, init_args: {alpha: 0.3}}\n", "algorithm: {class_path: feddyn}\n", "alpha", 0.01),
    ("algorithm: {class_path: moon, init_args: {mu: 0.3}}\n", "algorithm: fedprox\n", "mu", 0.01),
])
def test_an_algorithm_named_in_a_later_file_starts_from_its_own_defaults(tmp_path, first, second, field, expected):
    # The first file is a whole run (it sets more than the algorithm), as configs/quickstart.yaml is.
    parsed = parse("--config", QUICKSTART, "--config", write(tmp_path, "first.yaml", first + "seed: 3\n"),
                   "--config", write(tmp_path, "second.yaml", second))
    assert getattr(parsed.algorithm.init_args, field) == expected and parsed.seed == 3


def test_quickstart_composed_with_every_algorithm_file_takes_only_that_algorithms_settings():
    for name in sorted(SHORT_NAMES):
        files = [CONFIGS / "quickstart.yaml", CONFIGS / "algorithms" / f"{name}.yaml"]
        chosen = init_args(parse(*config_args(files)).algorithm)
        assert chosen == {**class_defaults(SHORT_NAMES[name]), **written_init_args(files[1:])}, name


def test_two_algorithm_files_are_refused_naming_both(tmp_path, capsys):
    fedprox, scaffold = CONFIGS / "algorithms" / "fedprox.yaml", CONFIGS / "algorithms" / "scaffold.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--config", str(fedprox), "--config", str(scaffold),
              "--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: config: expected one algorithm file (a run trains one algorithm; to switch, give --algorithm NAME "
        f"instead of a second file), got '{fedprox} choosing FedProx and {scaffold} choosing SCAFFOLD'"]
    assert not (tmp_path / "run").exists()


def test_every_pair_of_shipped_algorithm_files_is_refused_and_one_file_twice_is_not():
    for first in sorted(SHORT_NAMES):
        for second in sorted(SHORT_NAMES):
            argv = ["fit", *config_args([CONFIGS / "algorithms" / f"{first}.yaml",
                                         CONFIGS / "algorithms" / f"{second}.yaml"])]
            if first == second:
                check_config_files(argv)
            else:
                with pytest.raises(ConfigError, match="one algorithm file"):
                    check_config_files(argv)


def test_an_algorithm_on_the_command_line_still_replaces_the_files_one():
    chosen = parse(*config_args([CONFIGS / "quickstart.yaml", CONFIGS / "algorithms" / "fedprox.yaml"]),
                   "--algorithm", "scaffold").algorithm
    assert chosen.class_path.endswith("SCAFFOLD") and init_args(chosen) == class_defaults(SHORT_NAMES["scaffold"])


@pytest.mark.parametrize("plan", sorted((CONFIGS / "plans").glob("*.yaml")), ids=lambda path: path.stem)
def test_no_shipped_plan_composes_two_algorithm_files(plan):
    for point in load_plan(plan).grid():
        check_config_files(point.fit_arguments())


def test_a_later_file_without_a_class_changes_the_algorithm_already_chosen():
    # How tuned/<setting>/<algorithm>.yaml works: init_args only, composed after the algorithm.
    setting = "tinyimagenet_vit_tiny_ctpfl"
    parsed = parse(*config_args(composition(setting, "ctpfl", None)))
    assert parsed.algorithm.init_args.weight_decay == 0.05 and parsed.algorithm.init_args.span is None
    assert parsed.server_optimizer.init_args.lr == 0.1
