"""W&B groups hold one experiment's seeds; a run has one `method=` tag; method, plan and setting are
flat keys of its W&B config. Read from the offline run files, as `wandb sync` would upload them."""

import re
from pathlib import Path

import pytest
import yaml
from paths import QUICKSTART, REPOSITORY
from wandb_records import run_config, run_record

from fl_lightning.commands.main import main
from fl_lightning.experiments.plans.plan import load_plan

ONE_SHORT_ROUND = ["--model.options", "{hidden: 16, depth: 1}", "--federation.rounds", "1",
                   "--federation.local_steps", "2", "--logger.wandb_mode", "offline", "--logger.progress_bar", "false"]


def wandb_run(out_dir: Path):
    (run_file,) = sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return run_record(run_file), run_config(run_file)


def fedprox(tmp_path: Path, mu: float, seed: int):
    out_dir = tmp_path / f"mu{mu}-seed{seed}"
    main(["fit", "--config", QUICKSTART, "--config", str(REPOSITORY / "configs" / "algorithms" / "fedprox.yaml"),
          "--algorithm.init_args.mu", str(mu), "--seed", str(seed), *ONE_SHORT_ROUND, "--out_dir", str(out_dir)])
    return wandb_run(out_dir)


@pytest.mark.slow
def test_a_default_group_holds_the_seeds_of_one_experiment(tmp_path):
    (first, first_config), (second_seed, _), (other_mu, _) = (
        fedprox(tmp_path, 0.01, 0), fedprox(tmp_path, 0.01, 1), fedprox(tmp_path, 0.1, 0))
    assert first.run_group == second_seed.run_group != other_mu.run_group
    assert re.fullmatch(r"digits-alpha0\.5-mlp-fedprox-[0-9a-f]{8}", first.run_group)
    assert re.fullmatch(r"digits-alpha0\.5-mlp-fedprox-[0-9a-f]{8}", other_mu.run_group)
    digest = first.run_group.rsplit("-", 1)[1]
    assert (first.display_name, second_seed.display_name) == (f"fedprox-seed0-{digest}", f"fedprox-seed1-{digest}")
    assert other_mu.display_name != first.display_name
    assert sorted(first.tags) == ["alpha=0.5", "constraint=none", "dataset=digits", "method=fedprox", "model=mlp"]
    assert {key: first_config[key] for key in ("method", "plan", "setting")} == {
        "method": "fedprox", "plan": None, "setting": None}
    assert first_config["algorithm"]["init_args"]["mu"] == 0.01  # the run's own settings are still there


@pytest.mark.slow
def test_a_logger_tag_of_a_key_replaces_fits_own(tmp_path):
    main(["fit", "--config", QUICKSTART, *ONE_SHORT_ROUND, "--logger.tags", "[method=fedavg-warm, baseline]",
          "--out_dir", str(tmp_path)])
    record, config = wandb_run(tmp_path)
    assert sorted(record.tags) == ["alpha=0.5", "baseline", "constraint=none", "dataset=digits", "method=fedavg-warm",
                                   "model=mlp"]
    assert config["method"] == "fedavg-warm"


def test_a_sweep_run_has_one_method_tag_and_its_plan_method_and_setting_in_the_config(tmp_path):
    plan_file = tmp_path / "variants.yaml"
    plan_file.write_text(yaml.safe_dump({
        "name": "variants",
        "configs": [QUICKSTART],
        "methods": {"CTP-FL": [str(REPOSITORY / "configs" / "algorithms" / "ctpfl.yaml")],
                    "CTP-FL h=0": [str(REPOSITORY / "configs" / "algorithms" / "ctpfl.yaml"),
                                   {"algorithm.init_args.span": 0.0}]},
        "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}},
        "seeds": [0],
    }))
    point = next(p for p in load_plan(plan_file, runs_root=tmp_path / "runs").grid() if p.method == "CTP-FL h=0")
    main([*point.fit_arguments(), *ONE_SHORT_ROUND])
    record, config = wandb_run(point.out_dir)
    assert [tag for tag in record.tags if tag.startswith("method=")] == ["method=ctp-fl-h=0"]
    assert {"plan=variants", "setting=alpha-0.5", "dataset=digits"} <= set(record.tags)
    assert {key: config[key] for key in ("method", "plan", "setting")} == {
        "method": "ctp-fl-h=0", "plan": "variants", "setting": "alpha-0.5"}
    assert record.run_group == "variants-alpha-0.5-ctp-fl-h=0"
