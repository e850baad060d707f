"""The shipped sweep plans (configs/plans/) expand to the papers' grids, and their reference CSVs
(configs/references/) hold the papers' numbers under the plans' method and setting names.

The expected grids below are written from the papers (cited in the README), not from the plans:

- CTP-FL, Table 1 and section 5 ("Experimental setup", "Baselines and comparison budget"): CIFAR-100
  and Tiny-ImageNet, each with ResNet-18 and ViT-Tiny, Dirichlet 0.1 and 0.05; N = 100 clients, S = 10
  per round, K = 50 mini-batch gradients of batch 50 (local steps for the local-update methods), 300
  rounds; FedAvg, SCAFFOLD, FedCM, CTP-FL. Our rows besides: CTP-FL with h = 0 (sections 2, 3.4) and
  a grid over gamma with h = gamma (Theorem 4.3).
- FedCONST, Table 1 and section 4.1: Cross-Device (10% of 100 clients per round) CIFAR-10 alpha 0.5 and
  0.2, Cross-Silo (10 clients) CIFAR-10 and CIFAR-100 alpha 0.5; alpha 0.5 trains 5 local epochs,
  alpha 0.2 trains 10; LeNet-5 rows FedAvg, FedProx, MOON, SCAFFOLD, FedDyn and ResNet-18 rows also
  FedSAM, each "X" and "X + CONST". Appendix B.1: batch 50, local SGD lr 0.01, momentum 0.9, weight
  decay 1e-5; FedProx mu 0.01, MOON mu 0.01 and temperature 1, FedDyn alpha 1, FedSAM rho 1.0; no
  biases, no BatchNorm with the constraints.
  Beside each "X + CONST", the plans' "X + CONST (authors' code)": CONST as the authors' public code
  runs it (FedConst.py: the model-wide displacement mapped after each step), with biases and without
  weight decay, as that code trains; the paper has no number for it.
- FedCONST, Table 3 (appendix C.1): FedAvg, LeNet-5, CIFAR-10, alpha 0.5, with neither constraint,
  orthogonal only, centralization only, both; its numbers are Table 1's Cross-Silo CIFAR-10 column.

Every (setting, method) point of every plan is parsed by `fit`'s own parser and checked against these:
the setting's data, model and federation, the method's algorithm with exactly its own settings (the
class defaults, its fragments' values and the plan's, none of another method's), CONST on exactly
the rows that name it. The smoke plan is trained end to end and tabulated.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import pytest
import yaml
from jsonargparse import Namespace
from paths import REPOSITORY

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.cli.arguments import expand_short_names
from fl_lightning.cli.parser import GridPointParser, build_parser, parse_command_line
from fl_lightning.commands.main import main
from fl_lightning.experiments.plans.plan import GridPoint, Plan, load_plan
from fl_lightning.experiments.plans.tuning import TunedGrid
from fl_lightning.experiments.results.reference import read_reference
from fl_lightning.experiments.results.table import table

PLANS = REPOSITORY / "configs" / "plans"
pytestmark = pytest.mark.usefixtures("in_repository_root")


# --- the papers' grids ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column of a paper's table: what every run of it trains on."""

    dataset: str
    alpha: float
    model: str
    num_clients: int
    clients_per_round: int
    rounds: int
    batch_size: int = 50
    local_steps: Optional[int] = None
    local_epochs: Optional[int] = None
    bias: Optional[bool] = None
    """None: not fixed by the paper (the model's own default is then checked elsewhere, if at all)."""
    norm: Optional[str] = None
    client_sgd: Optional[tuple[float, float, float]] = None
    """(lr, momentum, weight decay) of the local SGD, where the paper gives them."""


@dataclass(frozen=True)
class Row:
    """One row of a paper's table: the algorithm and the values the paper (or the plan's design) gives."""

    algorithm: str
    init_args: dict = field(default_factory=dict)
    constraint: Optional[dict] = None
    """None: no constraint; else CONST with these options."""
    server_lr: float = 1.0
    tuned: dict = field(default_factory=dict)
    """Dotted setting -> the values the plan's tuning stage chooses from, per column (the plan's design)."""


@dataclass(frozen=True)
class Grid:
    columns: list[Column]
    """In the paper's order; the plan's settings must come in the same order."""
    rows: dict[str, Row]
    seeds: list[int]
    reference: Optional[str] = None


def paper_const(centralize: bool = True, orthogonal: bool = True) -> dict:
    """CONST as the paper writes it, with its Table 3 switches."""
    return {"centralize": centralize, "orthogonal": orthogonal, "granularity": "channel", "constrained": "weights",
            "when": "before_step", "order": "exact", "tensors": "matrices"}


CONST_BOTH = paper_const()
# FedConst.py's rule (configs/const_authors_code.yaml): the model-wide displacement after each step.
AUTHORS_CODE_CONST = {"centralize": True, "orthogonal": True, "granularity": "model", "constrained": "displacement",
                      "when": "after_step", "order": "centre_then_orthogonalise", "tensors": "all"}


def trained_column(column: Column, row: Row) -> Column:
    """The column as the row trains it: the authors' code keeps the biases and has no weight decay."""
    if row.constraint != AUTHORS_CODE_CONST:
        return column
    client_sgd = None if column.client_sgd is None else (*column.client_sgd[:2], 0.0)
    return replace(column, bias=True, client_sgd=client_sgd)

# CTP-FL, section 5: N = 100, S = 10, K = 50 local gradients of batch 50, 300 rounds.
CTPFL_COLUMNS = [
    Column(dataset=dataset, alpha=alpha, model=model, num_clients=100, clients_per_round=10, rounds=300,
           local_steps=50)
    for model in ("resnet18", "vit_tiny") for dataset in ("cifar100", "tiny_imagenet") for alpha in (0.1, 0.05)
]
CLIENT_LRS = {"client_optimizer.lr": [0.01, 0.03, 0.1]}
CTPFL_ROWS = {
    "FedAvg": Row("fedavg", tuned=CLIENT_LRS),
    "SCAFFOLD": Row("scaffold", tuned=CLIENT_LRS),
    "FedCM": Row("fedcm", {"alpha": 0.1}, tuned=CLIENT_LRS),
    # h = gamma (span null) as in Theorem 4.3; gamma itself is tuned per column (the paper gives none).
    "CTP-FL": Row("ctpfl", {"span": None}, tuned={"server_optimizer.init_args.lr": [0.1, 0.3, 0.5]}),
    "CTP-FL h=0": Row("ctpfl", {"span": 0.0}, server_lr=0.5),
    "CTP-FL gamma=0.1": Row("ctpfl", {"span": None}, server_lr=0.1),
    "CTP-FL gamma=0.3": Row("ctpfl", {"span": None}, server_lr=0.3),
    "CTP-FL gamma=1.0": Row("ctpfl", {"span": None}, server_lr=1.0),
}

# FedCONST, appendix B.1.
FEDCONST_SGD = (0.01, 0.9, 1e-5)
FEDCONST_HYPERPARAMETERS = {
    "FedAvg": Row("fedavg"),
    "FedProx": Row("fedprox", {"mu": 0.01}),
    "MOON": Row("moon", {"mu": 0.01, "tau": 1.0}),
    "SCAFFOLD": Row("scaffold"),
    "FedDyn": Row("feddyn", {"alpha": 1.0}),
    "FedSAM": Row("fedsam", {"rho": 1.0}),
}


def fedconst_rows(names: list[str]) -> dict[str, Row]:
    """Table 1's rows: each method, then the same method + CONST, then + CONST as the authors' code runs it."""
    rows = {}
    for name in names:
        row = FEDCONST_HYPERPARAMETERS[name]
        rows[name] = row
        rows[f"{name} + CONST"] = Row(row.algorithm, row.init_args, CONST_BOTH)
        rows[f"{name} + CONST (authors' code)"] = Row(row.algorithm, row.init_args, AUTHORS_CODE_CONST)
    return rows


def fedconst_column(model: str, federation: str, dataset: str, alpha: float) -> Column:
    # Section 4.1: cross-device samples 10% of 100 clients, cross-silo has 10; alpha 0.2 trains 10 local
    # epochs, alpha 0.5 trains 5. Rounds are not in the paper: 300 (configs/settings/cifar10_lenet5_fedconst.yaml).
    clients = {"cross-device": (100, 10), "cross-silo": (10, 10)}[federation]
    return Column(dataset=dataset, alpha=alpha, model=model, num_clients=clients[0], clients_per_round=clients[1],
                  rounds=300, local_epochs={0.5: 5, 0.2: 10}[alpha], bias=False, norm="none",
                  client_sgd=FEDCONST_SGD)


LENET_ROWS = fedconst_rows(["FedAvg", "FedProx", "MOON", "SCAFFOLD", "FedDyn"])
RESNET_ROWS = fedconst_rows(["FedAvg", "FedProx", "MOON", "SCAFFOLD", "FedDyn", "FedSAM"])
CROSS_DEVICE = [("cross-device", "cifar10", 0.5), ("cross-device", "cifar10", 0.2)]
CROSS_SILO = [("cross-silo", "cifar10", 0.5), ("cross-silo", "cifar100", 0.5)]
TABLE_3_ROWS = {
    "FedAvg": Row("fedavg"),
    "FedAvg + Orthogonal": Row("fedavg", constraint=paper_const(centralize=False)),
    "FedAvg + Center": Row("fedavg", constraint=paper_const(orthogonal=False)),
    "FedAvg + Orthogonal + Center": Row("fedavg", constraint=CONST_BOTH),
}
SEEDS = [0, 1, 2]  # neither paper says how many seeds

SMOKE_LRS = {"client_optimizer.lr": [0.05, 0.2, 0.5]}
EXPECTED = {
    "ctpfl_table1": Grid(CTPFL_COLUMNS, CTPFL_ROWS, SEEDS, "configs/references/ctpfl_table1.csv"),
    **{f"fedconst_table1_{model}_{federation}": Grid(
        [fedconst_column(model, *column) for column in columns],
        {"lenet5": LENET_ROWS, "resnet18": RESNET_ROWS}[model], SEEDS,
        f"configs/references/fedconst_table1_{model}_{federation}.csv")
       for model in ("lenet5", "resnet18")
       for federation, columns in (("cross-device", CROSS_DEVICE), ("cross-silo", CROSS_SILO))},
    "fedconst_table3": Grid([fedconst_column("lenet5", "cross-silo", "cifar10", 0.5)], TABLE_3_ROWS, SEEDS,
                            "configs/references/fedconst_table3.csv"),
    # Table 3's rows and setting with 20 rounds, every round evaluated, on the development copy, and
    # CONST as the authors' code runs it beside them; three seeds, for paired intervals.
    "dev_cifar10_const": Grid([Column(dataset="cifar10", alpha=0.5, model="lenet5", num_clients=10,
                                      clients_per_round=10, rounds=20, local_epochs=5, bias=False, norm="none",
                                      client_sgd=FEDCONST_SGD)],
                              {**TABLE_3_ROWS, "FedAvg + CONST (authors' code)": Row("fedavg",
                                                                                     constraint=AUTHORS_CODE_CONST)},
                              [0, 1, 2]),
    "smoke": Grid([Column(dataset="digits", alpha=alpha, model="mlp", num_clients=10, clients_per_round=5,
                          rounds=3, batch_size=32, local_steps=2) for alpha in (0.5, 0.1)],
                  {"FedAvg": Row("fedavg", tuned=SMOKE_LRS),
                   "FedAvg + CONST": Row("fedavg", constraint=CONST_BOTH, tuned=SMOKE_LRS)}, [0, 1, 2]),
    # FedAvg, SCAFFOLD, FedNova and CTP-FL under full participation, 2 cyclic groups of 5 (each drawn whole)
    # and 20% lost uploads (the participation itself: test_participation_plan_puts_participation_on_its_axis).
    "participation": Grid([Column(dataset="digits", alpha=0.5, model="mlp", num_clients=10, clients_per_round=drawn,
                                  rounds=30, batch_size=32, local_steps=10) for drawn in (10, 5, 10)],
                          {"FedAvg": Row("fedavg"), "SCAFFOLD": Row("scaffold", {"effective_steps": True}),
                           "FedNova": Row("fednova"), "CTP-FL": Row("ctpfl", {"span": None})}, [0, 1, 2]),
    # NIID-Bench's CIFAR-10 rows as Flower Baselines runs them: IID and Dirichlet 0.5, all 10 clients, SCAFFOLD's
    # option II as that code writes it.
    "niid_bench": Grid([Column(dataset="cifar10", alpha=0.5, model="lenet5", num_clients=10, clients_per_round=10,
                               rounds=50, batch_size=64, local_epochs=10, bias=True, norm="none",
                               client_sgd=(0.01, 0.9, 1e-5))] * 2,
                       {"FedAvg": Row("fedavg"), "SCAFFOLD": Row("scaffold", {"effective_steps": False}),
                        "FedProx": Row("fedprox", {"mu": 0.01}), "FedNova": Row("fednova")}, [0, 1, 2],
                       "configs/references/niid_bench.csv"),
}
SIZES = {"ctpfl_table1": 192, "fedconst_table1_lenet5_cross-device": 90, "fedconst_table1_lenet5_cross-silo": 90,
         "fedconst_table1_resnet18_cross-device": 108, "fedconst_table1_resnet18_cross-silo": 108,
         "fedconst_table3": 12, "dev_cifar10_const": 15, "smoke": 12, "participation": 36,
         "niid_bench": 24}


def shipped_plans() -> list[str]:
    return sorted(path.stem for path in PLANS.glob("*.yaml"))


def test_every_shipped_plan_has_its_expected_grid_here():
    assert shipped_plans() == sorted(EXPECTED)


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def load(name: str) -> Plan:
    return load_plan(PLANS / f"{name}.yaml")


def parse(parser, point: GridPoint):
    """The point's parsed (not instantiated) `fit` settings."""
    return parser.parse_args(expand_short_names(point.fit_arguments())).fit


# --- the grid: its size, rows, columns and seeds ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_plan_expands_to_the_papers_grid(name):
    plan, expected = load(name), EXPECTED[name]
    grid = plan.grid()
    assert plan.name == name
    assert len(grid) == SIZES[name] == len(expected.columns) * len(expected.rows) * len(expected.seeds)
    assert list(plan.methods) == list(expected.rows)
    assert plan.seeds == expected.seeds
    assert len({point.setting_name for point in grid}) == len(expected.columns)
    assert len({point.out_dir for point in grid}) == len(grid)
    assert (None if plan.reference is None else str(plan.reference)) == expected.reference
    assert plan.metric == "test_accuracy"
    # Setting names are folder names that `fl-lightning table` reads back: no "_" inside an axis value.
    for point in grid:
        assert all("_" not in axis + value and "-" not in axis for axis, value in point.setting.items())


def check_column(parsed, column: Column) -> None:
    assert parsed.data.name == column.dataset and parsed.data.alpha == column.alpha
    assert parsed.model.name == column.model
    federation = parsed.federation
    assert (federation.num_clients, federation.clients_per_round, federation.rounds, federation.batch_size) == (
        column.num_clients, column.clients_per_round, column.rounds, column.batch_size)
    assert (federation.local_steps, federation.local_epochs) == (column.local_steps, column.local_epochs)
    if column.bias is not None:
        assert parsed.model.bias is column.bias and parsed.model.norm == column.norm
    if column.client_sgd is not None:
        sgd = parsed.client_optimizer
        assert (sgd.lr, sgd.momentum, sgd.weight_decay) == column.client_sgd


def class_defaults(cls: type) -> dict:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.default is not p.empty}


def written_init_args(parts: list) -> dict:
    """The algorithm's init_args that a method's parts write, a later part over an earlier one."""
    written = {}
    for part in parts:
        if isinstance(part, str):
            spec = (yaml.safe_load(Path(part).read_text()) or {}).get("algorithm")
            if isinstance(spec, dict):
                written.update(spec.get("init_args") or {})
        else:
            written.update({key.removeprefix("algorithm.init_args."): value for key, value in part.items()
                            if key.startswith("algorithm.init_args.")})
    return written


def check_row(parsed, row: Row, method_parts: list) -> None:
    cls = SHORT_NAMES[row.algorithm]
    assert parsed.algorithm.class_path == f"{cls.__module__}.{cls.__qualname__}"
    chosen = dict(vars(parsed.algorithm.init_args)) if "init_args" in parsed.algorithm else {}
    # Exactly the class's defaults and what this method's own parts write: nothing from another method.
    assert chosen == {**class_defaults(cls), **written_init_args(method_parts)}
    assert row.init_args.items() <= chosen.items()
    tuned = {"client_optimizer.lr": parsed.client_optimizer.lr, "server_optimizer.init_args.lr":
             parsed.server_optimizer.init_args.lr}
    assert all(tuned[key] in values for key, values in row.tuned.items())
    if "server_optimizer.init_args.lr" not in row.tuned:
        assert parsed.server_optimizer.init_args.lr == row.server_lr
    if row.constraint is None:
        assert parsed.constraint is None
    else:
        assert parsed.constraint.class_path == "fl_lightning.constraints.CONST"
        options = parsed.constraint.init_args
        assert {name: getattr(options, name) for name in row.constraint} == row.constraint
        assert parsed.model.bias is (row.constraint["constrained"] == "displacement") and parsed.model.norm == "none"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_point_parses_to_its_column_and_its_row(name, parser):
    plan, expected = load(name), EXPECTED[name]
    grid = plan.grid()
    settings = list(dict.fromkeys(point.setting_name for point in grid))
    # Every (setting, method) pair at the first seed: a setting's values whatever the method, a method's
    # whatever the setting. Parsed as a sweep parses them (the first seed of each: in full), with the
    # parser that every plan of this module is parsed with.
    grid_parser = GridPointParser(parser)
    # A tuned method's own runs wait for their column's choice: its tuning runs show every candidate.
    assert {method: grid for method, grid in (plan.tune.methods if plan.tune else {}).items()} == {
        method: row.tuned for method, row in expected.rows.items() if row.tuned}
    tuning = [point for point in plan.tuning_grid() if point.setting_name == settings[0]]
    for point in [*tuning, *grid]:
        if point.seed != (plan.tune.seeds[0] if point.tuning else plan.seeds[0]):
            continue
        parsed = grid_parser.parse(point.fit_arguments()).fit
        row = expected.rows[point.method]
        check_column(parsed, trained_column(expected.columns[settings.index(point.setting_name)], row))
        check_row(parsed, row, plan.methods[point.method])
        assert parsed.seed == point.seed and parsed.out_dir == point.out_dir
        assert point.tuned.items() <= {key: value for key, value in (
            ("client_optimizer.lr", parsed.client_optimizer.lr),
            ("server_optimizer.init_args.lr", parsed.server_optimizer.init_args.lr))}.items()
    assert len(plan.tuning_grid()) == len(settings) * sum(len(list(itertools.product(*row.tuned.values())))
                                                          for row in expected.rows.values() if row.tuned)
    # The other seeds differ in the seed (and the run folder) only.
    first = grid[0]
    for point in grid[1:len(plan.seeds)]:
        assert (point.method, point.setting, point.parts) == (first.method, first.setting, first.parts)
        assert parse(parser, point).seed == point.seed
    # A sweep parses a later seed as its first seed's settings with its own seed, run folder and name:
    # the settings of a full parse of its command line by a parser of its own, for every seed of the
    # first method and the second seed of every method (of the first setting; the settings are
    # parsed alike).
    fresh = build_parser()
    later_seeds = [point for point in grid if point.setting_name == first.setting_name and point.seed != first.seed
                   and (point.method == first.method or point.seed == plan.seeds[1])]
    assert len(later_seeds) == len(plan.seeds) - 2 + len(plan.methods)
    full_parses = grid_parser.full_parses
    for point in later_seeds:
        assert grid_parser.parse(point.fit_arguments()) == parse_command_line(point.fit_arguments(), fresh)
    assert grid_parser.full_parses == full_parses  # each parsed from its first seed's settings


def test_participation_plan_puts_participation_on_its_axis(parser):
    parsed = {point.setting_name: GridPointParser(parser).parse(point.fit_arguments()).fit.federation
              for point in load("participation").grid() if point.seed == 0 and point.method == "FedAvg"}
    assert [(federation.participation, federation.dropout) for federation in parsed.values()] == [
        (None, 0.0), (Namespace(class_path="fl_lightning.participation.Cyclic", init_args=Namespace(groups=2)), 0.0),
        (None, 0.2)]


@pytest.mark.parametrize("after, seed", [(["--config", "seed.yaml"], 7), (["--seed", "5"], 5)],
                         ids=["a later config file", "the option again"])
def test_seeds_whose_seed_a_later_argument_sets_again_are_each_parsed_in_full(parser, tmp_path, after, seed):
    (tmp_path / "seed.yaml").write_text("seed: 7\n")
    after = [str(tmp_path / arg) if arg.endswith(".yaml") else arg for arg in after]
    grid_parser = GridPointParser(parser)
    first, second = load("smoke").grid()[:2]
    assert (first.method, first.setting, first.seed, second.seed) == (second.method, second.setting, 0, 1)
    for point in (first, second):
        argv = [*point.fit_arguments(), *after]
        parsed = grid_parser.parse(argv)
        assert parsed == parse_command_line(argv, parser) and parsed.fit.seed == seed
    assert grid_parser.full_parses == 2


# --- the reference numbers --------------------------------------------------------------------------------


def reference_columns(path: str) -> list[str]:
    return [column.strip() for column in Path(path).read_text().splitlines()[0].split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(name for name, grid in EXPECTED.items() if grid.reference))
def test_reference_names_the_plans_methods_and_settings(name, tmp_path):
    plan = load(name)
    settings = list(dict.fromkeys(point.setting_name for point in plan.grid()))
    reference = read_reference(plan.reference)
    assert list(reference) == list(plan.methods)
    assert reference_columns(plan.reference) == ["method", *settings]
    # `fl-lightning table` finds every number (no runs needed for the paper's column).
    result = table(plan=str(PLANS / f"{name}.yaml"), runs_root=tmp_path / "runs", out=tmp_path / "table")
    for method, values in reference.items():
        for setting in settings:
            assert result.cell(method, setting).paper == values[setting]


def numbers(name: str) -> dict[str, list[Optional[float]]]:
    path = EXPECTED[name].reference
    reference = read_reference(path)
    return {method: [values[column] for column in reference_columns(path)[1:]] for method, values in reference.items()}


def test_ctpfl_reference_agrees_with_the_gains_stated_in_the_text():
    # Section 5, "Main results": CTP-FL's gain over the strongest listed baseline in each column.
    gains = [2.64, 1.51, 7.86, 7.89, 22.93, 21.81, 15.44, 13.18]
    table_1 = numbers("ctpfl_table1")
    for column, gain in enumerate(gains):
        best_baseline = max(table_1[method][column] for method in ("FedAvg", "SCAFFOLD", "FedCM"))
        assert table_1["CTP-FL"][column] - best_baseline == pytest.approx(gain, abs=1e-6)
    # Only the paper's rows have numbers.
    assert all(value is None for method in ("CTP-FL h=0", "CTP-FL gamma=0.1", "CTP-FL gamma=0.3",
                                            "CTP-FL gamma=1.0") for value in table_1[method])


# Table 1's numbers in parentheses, "the accuracy differences when Constraint was applied", column by column
# (Cross-Device alpha 0.5, alpha 0.2, Cross-Silo CIFAR-10, CIFAR-100).
CONST_GAINS = {
    "lenet5": {"FedAvg": [8.16, 8.37, 6.54, 9.40], "FedProx": [7.51, 10.91, 5.55, 8.36],
               "MOON": [4.77, 6.22, 4.07, 8.04], "SCAFFOLD": [8.16, 10.95, 10.29, 9.08],
               "FedDyn": [9.14, 7.62, 8.71, 10.35]},
    "resnet18": {"FedAvg": [12.44, 11.37, 8.19, 3.31], "FedProx": [6.72, 14.15, 7.45, 2.45],
                 "MOON": [9.10, 11.01, 3.39, 1.61], "SCAFFOLD": [7.02, 9.33, 10.59, 1.75],
                 "FedDyn": [11.65, 10.91, 6.26, 2.15], "FedSAM": [0.93, 7.52, 3.19, 1.18]},
}


@pytest.mark.parametrize("model", ["lenet5", "resnet18"])
def test_fedconst_reference_agrees_with_the_differences_in_parentheses(model):
    table_1 = {method: numbers(f"fedconst_table1_{model}_cross-device")[method]
               + numbers(f"fedconst_table1_{model}_cross-silo")[method] for method in EXPECTED[
                   f"fedconst_table1_{model}_cross-device"].rows}
    for method, gains in CONST_GAINS[model].items():
        for column, gain in enumerate(gains):
            assert table_1[f"{method} + CONST"][column] - table_1[method][column] == pytest.approx(gain, abs=1e-6)


def test_table_3_shares_table_1s_cross_silo_cifar10_numbers():
    # Table 3's "neither" and "both" rows are Table 1's LeNet-5 FedAvg and FedAvg + CONST, Cross-Silo CIFAR-10.
    table_3 = numbers("fedconst_table3")
    table_1 = numbers("fedconst_table1_lenet5_cross-silo")
    assert table_3["FedAvg"][0] == table_1["FedAvg"][0] == 53.12
    assert table_3["FedAvg + Orthogonal + Center"][0] == table_1["FedAvg + CONST"][0] == 59.66
    assert (table_3["FedAvg + Orthogonal"][0], table_3["FedAvg + Center"][0]) == (56.77, 51.99)


# --- the smoke plan trains and tabulates -------------------------------------------------------------


@pytest.mark.slow
def test_smoke_plan_tunes_trains_every_point_and_tabulates(tmp_path):
    runs = tmp_path / "runs"
    plan = load_plan(PLANS / "smoke.yaml", runs_root=runs)
    for point in plan.tuning_grid():  # each method's three client lrs on seed 100, in each split
        main(point.fit_arguments())
    grid = TunedGrid(plan)
    for cell in grid.cells():
        grid.choose(cell, ended=False)  # every tuning run finished: none is waited for
    for point in grid.final_points:
        assert not point.waiting
        main(point.fit_arguments())
    result = table(plan=str(PLANS / "smoke.yaml"), runs_root=runs, baseline="FedAvg", format="latex")
    assert result.methods == ["FedAvg", "FedAvg + CONST"]
    assert result.settings == ["alpha-0.5", "alpha-0.1"]
    assert all(cell.n == 3 for cell in result.cells.values())
    tuned = [note for note in result.notes if note.startswith("tuned ")]
    assert [note.split(" (every candidate's figure in ")[0] for note in tuned] == [
        f"tuned {method} on seed(s) 100 by the best val_accuracy at the final round"
        for method in ("FedAvg", "FedAvg + CONST")]
    # The others: the choices at an edge of the smoke plan's grid of three client lrs.
    assert all(" edge of its grid (0.05 to 0.5): widen it" in note for note in result.notes if note not in tuned)
    # Its three seeds pair up: each column of FedAvg + CONST has its interval of the difference to FedAvg.
    for setting in result.settings:
        versus = result.cells["FedAvg + CONST", setting].versus
        assert versus.seeds == [0, 1, 2] and not versus.unpaired and versus.interval is not None
    assert all((runs / "smoke" / name).is_file() for name in ("table.md", "table.csv", "table.tex", "plot.png"))


# --- NIID-Bench's plan, scaled to the CPU, trains and is tabulated beside its published figures -----------


@pytest.mark.slow
def test_niid_bench_plan_scaled_down_trains_and_tabulates_beside_the_published_figures(tmp_path, cifar_root):
    runs = tmp_path / "runs"
    scaled = [f"data.root={cifar_root}", "federation.rounds=1", "federation.local_epochs=1",
              "federation.batch_size=32", "logger.progress_bar=false"]
    plan = load_plan(PLANS / "niid_bench.yaml", runs_root=runs, overrides=scaled)
    points = [point for point in plan.grid() if point.seed == plan.seeds[0]]
    partitions = {}
    for point in points:
        main([*point.fit_arguments(), "--fabric.accelerator", "cpu", "--fabric.devices", "1"])  # one rank, as a sweep
        partitions.setdefault(point.setting_name, set()).add(
            yaml.safe_load((point.out_dir / "config.yaml").read_text())["data"]["partition"])
    assert partitions == {"split-iid": {"iid"}, "split-dirichlet": {"dirichlet"}}
    result = table(plan=str(PLANS / "niid_bench.yaml"), runs_root=runs, at="best", override=scaled,
                   out=tmp_path / "table")
    assert result.methods == ["FedAvg", "SCAFFOLD", "FedProx", "FedNova"]
    assert all(cell.n == 1 for cell in result.cells.values())
    published = read_reference(REPOSITORY / "configs" / "references" / "niid_bench.csv")
    assert published["SCAFFOLD"] == {"split-iid": 71.66, "split-dirichlet": 68.08}
