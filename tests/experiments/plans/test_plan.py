"""Sweep plans expand to their grid, name every run after its grid point, and refuse bad plans: their
own keys when loaded, and every point's settings as `fit` checks them before any run starts."""

from pathlib import Path

import pytest
import yaml
from paths import QUICKSTART

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan, slug
from fl_lightning.experiments.plans.resolve import check_grid, resolve_grid


def write_plan(tmp_path: Path, **plan) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def test_grid_is_settings_by_methods_by_seeds_with_run_folders_named_after_the_point(tmp_path):
    plan = load_plan(write_plan(
        tmp_path, name="demo", configs=[QUICKSTART],
        methods={"FedAvg": [{"algorithm": "fl_lightning.algorithms.FedAvg"}],
                 "FedProx + CONST": [{"algorithm": "fl_lightning.algorithms.fedprox.FedProx"},
                                     {"algorithm.init_args.mu": 0.1}]},
        settings={"alpha": {"0.5": [{"data.alpha": 0.5}], "0.1": [{"data.alpha": 0.1}]},
                  "clients": {"10": [{"federation.num_clients": 10}]}},
        seeds=[0, 1, 2]), runs_root=tmp_path / "runs")
    grid = plan.grid()
    assert len(grid) == 2 * 2 * 3
    assert [p.index for p in grid] == list(range(12))
    first = grid[0]
    assert (first.method, first.setting, first.seed) == ("FedAvg", {"alpha": "0.5", "clients": "10"}, 0)
    assert first.out_dir == tmp_path / "runs" / "demo" / "alpha-0.5_clients-10" / "fedavg" / "seed0"
    assert grid[3].out_dir.parent.name == "fedprox+const"
    assert len({p.out_dir for p in grid}) == len(grid)


def test_every_point_parses_with_its_method_settings_last(tmp_path):
    plan = load_plan(write_plan(
        tmp_path, name="demo", configs=[QUICKSTART],
        methods={"FedProx": [{"algorithm": "fl_lightning.algorithms.fedprox.FedProx"},
                             {"algorithm.init_args.mu": 0.1}]},
        settings={"alpha": {"0.1": [{"data.alpha": 0.1}]}}, seeds=[4]))
    (resolved,) = resolve_grid(plan.grid())
    config = resolved.config  # what fit records in config.yaml
    assert config["algorithm"]["class_path"] == "fl_lightning.algorithms.fedprox.FedProx"
    assert config["algorithm"]["init_args"]["mu"] == 0.1
    assert config["data"]["alpha"] == 0.1 and config["seed"] == 4 and resolved.rounds == 30
    assert config["logger"]["group"] == "demo-alpha-0.1-fedprox" and config["logger"]["name"] == "fedprox-seed4"
    assert "plan=demo" in config["logger"]["tags"]
    assert config["out_dir"] == str(resolved.point.out_dir)


@pytest.mark.parametrize("plan, key", [
    ({"name": "Bad Name", "methods": {"a": []}}, "plan.name"),
    ({"name": "x"}, "plan.methods"),
    ({"name": "x", "methods": {"a": [], "A": []}}, "plan.methods"),
    ({"name": "x", "methods": {"a": ["missing.yaml"]}}, "plan.methods.a"),
    ({"name": "x", "methods": {"a": [3]}}, "plan.methods.a"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": []}}, "plan.settings"),
    ({"name": "x", "methods": {"a": []}, "seeds": [-1]}, "plan.seeds"),
    ({"name": "x", "methods": {"a": []}, "sedes": [1]}, "plan"),
    # Points that would share one run folder, or a folder outside the runs root.
    ({"name": "x", "methods": {"a": []}, "seeds": [0, 0]}, "plan.seeds"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": {0.5: [], "0.5": []}}}, "plan.settings.alpha"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": {"../../../escaped": []}}}, "plan.settings.alpha"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": {"a/b": []}}}, "plan.settings.alpha"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": {"..": []}}}, "plan.settings.alpha"),
    ({"name": "x", "methods": {"..": []}}, "plan.methods"),
    ({"name": "x", "methods": {"FedAvg": [], "fedavg": []}}, "plan.methods"),
    ({"name": "x", "methods": {"a": []}, "settings": {"local-steps": {"5": []}}}, "plan.settings"),
])
def test_bad_plans_are_refused_naming_the_key(plan, key, tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_plan(write_plan(tmp_path, **plan))
    assert raised.value.field_name == key


def test_every_point_is_checked_as_fit_checks_it_naming_the_plan_the_point_and_the_field(tmp_path):
    plan_file = write_plan(
        tmp_path, name="demo", configs=[QUICKSTART],
        methods={"FedAvg": [{"algorithm": "fedavg"}],
                 "FedProx": [{"algorithm": "fedprox"}, {"algorithm.init_args.mu": -1}],
                 "Typo": [{"federation.round": 5}],
                 "Unknown": [{"algorithm": "fedfoo"}]},
        seeds=[0])
    resolved = resolve_grid(load_plan(plan_file).grid())
    assert resolved[0].error is None
    with pytest.raises(ConfigError) as refused:
        check_grid(plan_file, resolved)
    message = str(refused.value)
    assert refused.value.field_name == "plan" and str(plan_file) in message and "3 of 4 are refused" in message
    lines = message.splitlines()[1:]
    assert lines[0].startswith("  [1] FedProx | default | seed 0: algorithm.init_args.mu: expected a value >= 0")
    assert lines[1].startswith("  [2] Typo | default | seed 0: federation.round: expected a known setting")
    assert lines[2].startswith("  [3] Unknown | default | seed 0: algorithm: expected an algorithm")


def test_slug():
    assert slug("FedAvg + CONST") == "fedavg+const"
    assert slug("CTP-FL h=0") == "ctp-fl-h=0"
