"""Sweep plans expand to their grid, name every run after its grid point, and refuse bad plans."""

from pathlib import Path

import pytest
import yaml

from fl_lightning.cli.arguments import expand_short_names
from fl_lightning.cli.parser import build_parser
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plan import load_plan, slug

QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")


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
    (point,) = plan.grid()
    parser = build_parser()
    arguments = parser.instantiate(parser.parse_args(expand_short_names(point.fit_arguments()))).fit
    assert type(arguments.algorithm).__name__ == "FedProx" and arguments.algorithm.mu == 0.1
    assert arguments.data.alpha == 0.1 and arguments.seed == 4
    assert arguments.logger.group == "demo-alpha-0.1-fedprox" and arguments.logger.name == "fedprox-seed4"
    assert "plan=demo" in arguments.logger.tags


@pytest.mark.parametrize("plan, key", [
    ({"name": "Bad Name", "methods": {"a": []}}, "plan.name"),
    ({"name": "x"}, "plan.methods"),
    ({"name": "x", "methods": {"a": [], "A": []}}, "plan.methods"),
    ({"name": "x", "methods": {"a": ["missing.yaml"]}}, "plan.methods.a"),
    ({"name": "x", "methods": {"a": [3]}}, "plan.methods.a"),
    ({"name": "x", "methods": {"a": []}, "settings": {"alpha": []}}, "plan.settings"),
    ({"name": "x", "methods": {"a": []}, "seeds": [-1]}, "plan.seeds"),
    ({"name": "x", "methods": {"a": []}, "sedes": [1]}, "plan"),
])
def test_bad_plans_are_refused_naming_the_key(plan, key, tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_plan(write_plan(tmp_path, **plan))
    assert raised.value.field_name == key


def test_slug():
    assert slug("FedAvg + CONST") == "fedavg+const"
    assert slug("CTP-FL h=0") == "ctp-fl-h=0"
