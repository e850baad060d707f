"""Callback state across resumes, and stops that are final.

A run interrupted after every round, each time resumed by the same command, must end with the
metrics rows (timings aside) and the model of an uninterrupted run, with every stateful callback
and every diagnostic on. A run stopped for good (early stopping, a user callback's decision)
trains nothing when its command runs again, also with more rounds.
"""

from pathlib import Path

import pytest
import torch
import yaml
from paths import CONFIGS, SUPPORT

from fl_lightning.checkpoint import (
    CALLBACKS,
    DIGEST,
    FINAL_STOP,
    LAST,
    PENDING_FINAL_STOPS,
    checkpoint_dir,
    content_digest,
    run_is_over,
)
from fl_lightning.commands.main import main
from fl_lightning.diagnostics.base import DIAG_GRAD_EVALS
from fl_lightning.federation.aggregation import is_final_vote, stop_vote
from fl_lightning.run_dir import DifferentExperiment, check_same_experiment
from fl_lightning.run_logging import read_metrics

# End to end: the tests train runs in-process.
pytestmark = pytest.mark.slow
TINY = ["--config", str(CONFIGS / "quickstart.yaml"), "--model.options", "{hidden: 16, depth: 1}",
        "--federation.local_steps", "2", "--federation.eval_every", "1", "--logger.progress_bar", "false",
        "--resume", "auto"]
INTERRUPT = {"class_path": "recording_callbacks.InterruptEveryRound"}
EARLY_STOPPING = {"class_path": "fl_lightning.callbacks.EarlyStopping",
                  "init_args": {"patience": 2, "min_delta": 0.003}}
EARLY_STOPPED = [*TINY, "--federation.rounds", "30"]
# Every diagnostic at once, on CTP-FL (DisplacementBias needs it), small, with a time budget that
# never runs out: what they keep within a round must not leak into the rounds a resume runs.
DIAGNOSTICS = [
    {"class_path": "fl_lightning.callbacks.TimeBudget", "init_args": {"max_seconds": 1.0e6}},
    {"class_path": "fl_lightning.diagnostics.ctpfl.DisplacementBias"},
    *({"class_path": f"fl_lightning.diagnostics.local_updates.{name}"}
      for name in ("ClientDrift", "DriftDiversity", "ClientConsistency", "UpdateCosine")),
    {"class_path": "fl_lightning.diagnostics.gsnr.GradientVariance", "init_args": {"num_batches": 2}},
    {"class_path": "fl_lightning.diagnostics.gsnr.GSNR", "init_args": {"num_batches": 3, "batch_size": 2}},
    {"class_path": "fl_lightning.diagnostics.gsnr.WeightNorms"},
    {"class_path": "fl_lightning.diagnostics.landscape.Landscape",
     "init_args": {"every": 1, "subset_size": 64, "iterations": 3, "probes": 2}},
]
WITH_DIAGNOSTICS = [*TINY, "--algorithm", "ctpfl", "--federation.rounds", "3"]


@pytest.fixture(autouse=True)
def importable_test_callbacks(monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))


def with_callbacks(tmp_path: Path, arguments: list[str], callbacks: list[dict], name: str) -> list[str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"callbacks": callbacks}))
    return [*arguments, "--config", str(path)]


def fit(arguments: list[str], out_dir: Path) -> None:
    main(["fit", *arguments, "--out_dir", str(out_dir)])


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in rows]


def last_checkpoint(out_dir: Path) -> dict:
    return torch.load(checkpoint_dir(out_dir) / LAST, map_location="cpu", weights_only=False)


def assert_same_model(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def run_until_nothing_is_left(arguments: list[str], out_dir: Path) -> int:
    """Runs the same command until a run trains nothing; returns how many runs trained (each must
    have trained exactly one round)."""
    runs = 0
    while True:
        before = len(read_metrics(out_dir))
        fit(arguments, out_dir)
        after = len(read_metrics(out_dir))
        if after == before:
            return runs
        assert after == before + 1
        runs += 1


@pytest.mark.parametrize("arguments, callbacks", [(EARLY_STOPPED, [EARLY_STOPPING]), (WITH_DIAGNOSTICS, DIAGNOSTICS)],
                         ids=["early stopping", "time budget and every diagnostic"])
def test_a_run_interrupted_after_every_round_matches_the_uninterrupted_run(arguments, callbacks, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    fit(with_callbacks(tmp_path, arguments, callbacks, "callbacks"), uninterrupted)
    expected_rows = read_metrics(uninterrupted)

    interrupted = tmp_path / "interrupted"
    runs = run_until_nothing_is_left(with_callbacks(tmp_path, arguments, [*callbacks, INTERRUPT], "interrupting"),
                                     interrupted)
    assert runs == len(expected_rows)
    assert without_timings(read_metrics(interrupted)) == without_timings(expected_rows)
    if callbacks == DIAGNOSTICS:  # their passes counted on across the resumes
        assert expected_rows[-1][DIAG_GRAD_EVALS] > expected_rows[0][DIAG_GRAD_EVALS] > 0
    assert_same_model(last_checkpoint(interrupted)["model"], last_checkpoint(uninterrupted)["model"])
    if callbacks == [EARLY_STOPPING]:
        # Stopped early, and for good: the last interruption came with the final stop itself.
        assert len(expected_rows) < 30
        for out_dir in (uninterrupted, interrupted):
            assert last_checkpoint(out_dir)[FINAL_STOP].startswith("early stopping: test_accuracy has not improved")


def test_an_early_stopped_run_trains_nothing_when_run_again_also_with_more_rounds(tmp_path, capsys):
    out_dir = tmp_path / "run"
    arguments = with_callbacks(tmp_path, EARLY_STOPPED, [EARLY_STOPPING], "callbacks")
    fit(arguments, out_dir)
    stopped_at = len(read_metrics(out_dir))
    assert stopped_at < 30
    checkpoints = {p.name: p.read_bytes() for p in checkpoint_dir(out_dir).iterdir()}
    assert f"stopped for good (early stopping: test_accuracy has not improved for 2 evaluations; the same command " \
           f"trains nothing more) at round {stopped_at}/30" in capsys.readouterr().out

    for rounds in ("30", "60"):
        fit([*arguments, "--federation.rounds", rounds], out_dir)
        assert f"{out_dir} holds a run stopped for good at round {stopped_at} (early stopping: test_accuracy has " \
               f"not improved for 2 evaluations); nothing to train, also with federation.rounds {rounds}" \
               in capsys.readouterr().err
        assert len(read_metrics(out_dir)) == stopped_at
        assert {p.name: p.read_bytes() for p in checkpoint_dir(out_dir).iterdir()} == checkpoints


def test_a_user_callbacks_stop_is_final_unless_it_says_it_is_an_interruption(tmp_path):
    stops = {"final": {}, "interruption": {"final": False}}
    for name, final in stops.items():
        stop = {"class_path": "recording_callbacks.StopAfterRound", "init_args": {"round": 1, **final}}
        arguments = with_callbacks(tmp_path, [*TINY, "--federation.rounds", "4"], [stop], name)
        fit(arguments, tmp_path / name)
        assert len(read_metrics(tmp_path / name)) == 2  # asked at the end of round 1, agreed in round 2
        fit(arguments, tmp_path / name)
    assert len(read_metrics(tmp_path / "final")) == 2
    assert last_checkpoint(tmp_path / "final")[FINAL_STOP] == "asked to stop after round 1"
    assert len(read_metrics(tmp_path / "interruption")) == 4
    assert last_checkpoint(tmp_path / "interruption")[FINAL_STOP] is None


def test_a_final_stop_agreed_with_a_requeue_is_not_requeued(tmp_path):
    decisions = [{"class_path": "recording_callbacks.StopAfterRound", "init_args": {"round": 1}},
                 {"class_path": "recording_callbacks.RequeueInRound", "init_args": {"round": 2}}]
    out_dir = tmp_path / "run"
    fit(with_callbacks(tmp_path, [*TINY, "--federation.rounds", "4"], decisions, "callbacks"), out_dir)
    assert len(read_metrics(out_dir)) == 2
    assert last_checkpoint(out_dir)[FINAL_STOP] == "asked to stop after round 1"
    assert (out_dir / "requeue_agreed.txt").read_text() == "False"


def interrupted_early_stopping_run(tmp_path: Path) -> Path:
    """A run with EarlyStopping interrupted after round 2, its state saved."""
    out_dir = tmp_path / "run"
    stop = {"class_path": "recording_callbacks.StopAfterRound", "init_args": {"round": 1, "final": False}}
    fit(with_callbacks(tmp_path, EARLY_STOPPED, [EARLY_STOPPING, stop], "first"), out_dir)
    assert set(last_checkpoint(out_dir)[CALLBACKS]) == {"1:EarlyStopping"}  # 0 is the run's own Evaluate
    return out_dir


@pytest.mark.parametrize("resumed_with, got", [
    ([], "0:Evaluate, 1:SaveCheckpoint"),
    ([{"class_path": "fl_lightning.diagnostics.gsnr.WeightNorms"}, EARLY_STOPPING],
     "0:Evaluate, 1:WeightNorms, 2:EarlyStopping"),
], ids=["removed", "moved"])
def test_a_checkpoint_whose_callback_states_do_not_fit_the_callbacks_is_refused(resumed_with, got, tmp_path, capsys):
    out_dir = interrupted_early_stopping_run(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        fit(with_callbacks(tmp_path, EARLY_STOPPED, resumed_with, "resumed"), out_dir)
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("error: callbacks: expected EarlyStopping at position 1 of the run's callbacks, whose "
                            "state the checkpoint of round 2 holds (a resumed run keeps its callbacks in their order; "
                            f"add new ones after them), got '{got}, ")
    assert len(read_metrics(out_dir)) == 2


def test_a_resume_that_changes_a_callbacks_arguments_is_refused_naming_each(tmp_path, capsys):
    """EarlyStopping's patience and min_delta change when the run stops: the resumed run would match no
    uninterrupted one."""
    out_dir = interrupted_early_stopping_run(tmp_path)
    capsys.readouterr()
    changed = {**EARLY_STOPPING, "init_args": {"patience": 50, "min_delta": 0.0}}
    with pytest.raises(SystemExit) as exited:
        fit(with_callbacks(tmp_path, EARLY_STOPPED, [changed], "resumed"), out_dir)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-4:] == [
        "error: out_dir: expected a folder of its own for a different experiment: the run in it (the checkpoint of "
        "round 2) was made with other settings, which a resume cannot change:",
        "  callbacks.EarlyStopping.min_delta: 0.003 -> 0.0",
        "  callbacks.EarlyStopping.patience: 2 -> 50",
        "Keep those settings to continue that run, or give this experiment another out_dir (a callback's arguments "
        f"are not part of the name of the default one), got '{out_dir}'",
    ]
    assert len(read_metrics(out_dir)) == 2


def test_a_time_budget_and_a_diagnostics_cadence_may_change_on_resume(tmp_path, capsys):
    out_dir = tmp_path / "run"
    stop = {"class_path": "recording_callbacks.StopAfterRound", "init_args": {"round": 1, "final": False}}

    def carried_out_with(seconds: float, every: int) -> list[dict]:
        return [{"class_path": "fl_lightning.callbacks.TimeBudget", "init_args": {"max_seconds": seconds}},
                {"class_path": "fl_lightning.diagnostics.gsnr.WeightNorms", "init_args": {"every": every}}]

    arguments = [*TINY, "--federation.rounds", "4"]
    fit(with_callbacks(tmp_path, arguments, [*carried_out_with(1.0e6, 1), stop], "first"), out_dir)
    assert len(read_metrics(out_dir)) == 2
    fit(with_callbacks(tmp_path, arguments, carried_out_with(2.0e6, 2), "resumed"), out_dir)
    rows = read_metrics(out_dir)
    assert [row["round"] for row in rows] == [1, 2, 3, 4]
    measured = [any(name.startswith("weight_norm/") for name in row) for row in rows]
    assert measured == [True, True, False, True]  # every round, then every second one
    assert "resuming with changed settings: callbacks" in capsys.readouterr().err


def test_callbacks_are_compared_by_class_in_their_order_and_added_ones_are_not():
    def early_stopping(patience: int) -> dict:
        return {"class_path": "fl_lightning.callbacks.EarlyStopping", "init_args": {"patience": patience}}

    weight_norms = {"class_path": "fl_lightning.diagnostics.gsnr.WeightNorms", "init_args": {"every": 1}}
    recorded = {"seed": 0, "callbacks": [early_stopping(5), early_stopping(9)]}
    requested = {"seed": 0, "callbacks": [weight_norms, early_stopping(5), early_stopping(3), weight_norms]}
    with pytest.raises(DifferentExperiment) as refused:
        check_same_experiment(recorded, requested, "config.yaml", Path("runs/x"))
    assert refused.value.refused == {"callbacks.EarlyStopping#2.patience": (9, 3)}
    requested["callbacks"][2] = early_stopping(9)
    assert set(check_same_experiment(recorded, requested, "config.yaml", Path("runs/x"))) == {"callbacks"}


def test_a_checkpoint_without_callback_state_still_resumes(tmp_path):
    out_dir = interrupted_early_stopping_run(tmp_path)
    # Written again as an earlier version wrote them (last.ckpt is a hard link to the newest: once per file).
    for path in {p.stat().st_ino: p for p in checkpoint_dir(out_dir).glob("*.ckpt")}.values():
        state = torch.load(path, map_location="cpu", weights_only=False)
        for key in (DIGEST, FINAL_STOP, PENDING_FINAL_STOPS, CALLBACKS):
            del state[key]
        torch.save({**state, DIGEST: content_digest(state)}, path)
    fit(with_callbacks(tmp_path, EARLY_STOPPED, [EARLY_STOPPING], "resumed"), out_dir)
    assert len(read_metrics(out_dir)) > 2
    assert last_checkpoint(out_dir)[FINAL_STOP].startswith("early stopping")


def test_run_is_over_when_the_rounds_are_reached_or_a_final_stop_is_recorded():
    assert run_is_over({"round": 5}, 5)
    assert not run_is_over({"round": 4}, 5)
    assert not run_is_over({"round": 4, FINAL_STOP: None}, 5)
    assert run_is_over({"round": 4, FINAL_STOP: "early stopping: test_accuracy has not improved"}, 10)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_one_stop_slot_tells_every_rank_whether_any_asked_to_stop_and_whether_for_good(world_size):
    # Every rank asks the same, then one rank alone asks for a final stop, then all but one interrupt.
    cases = [([False] * world_size, False), ([True] * world_size, True),
             ([True] + [None] * (world_size - 1), True), ([False] * (world_size - 1) + [None], False)]
    for asked, final in cases:
        if asked == [None] * world_size:
            continue  # "all but one" on one rank
        total = sum(stop_vote([] if a is None else [a], world_size) for a in asked)
        assert total > 0
        assert is_final_vote(total, world_size) == final
    assert stop_vote([], world_size) == 0
    assert stop_vote([False, True], world_size) == stop_vote([True], world_size)
