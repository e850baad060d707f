"""Callbacks: the hooks fire in order on every rank, a user callback from YAML can stop a run that
then resumes, the built-in stop rules, and every configurable class round-trips through config.yaml."""

import io
import os
import sys
import types
from pathlib import Path

import processes
import pytest
import torch
import yaml
from paths import QUICKSTART, SUPPORT

from fl_lightning import server_optimizers
from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.callbacks import EarlyStopping, ShowProgress, TimeBudget
from fl_lightning.checkpoint import checkpoint_dir, numbered_checkpoints
from fl_lightning.cli.parser import build_parser
from fl_lightning.commands.main import main
from fl_lightning.constraints import CONST
from fl_lightning.federation.aggregation import clients_of_rank, sample_clients
from fl_lightning.fit import _as_config
from fl_lightning.run_logging import read_metrics

TINY = ["--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--federation.local_steps", "2",
        "--federation.eval_every", "2", "--logger.progress_bar", "false", "--resume", "auto"]


@pytest.fixture(autouse=True)
def importable_test_callbacks(monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))


def hooks_config(tmp_path: Path, *callbacks: dict) -> str:
    path = tmp_path / "callbacks.yaml"
    path.write_text(yaml.safe_dump({"callbacks": list(callbacks)}))
    return str(path)


def recorded_hooks(folder: Path, rank: int) -> tuple[list[str], dict[int, list[tuple[int, float]]]]:
    """The hooks a rank saw, without on_client_end, and per round the (client, weight) pairs that
    on_client_end saw; client_end lines are checked to come between their round's start and end."""
    hooks, clients, current = [], {}, None
    for line in (folder / f"hooks_rank{rank}.txt").read_text().splitlines():
        words = line.split(" ")
        if words[0] == "client_end":
            assert int(words[1]) == current and "'pseudo_gradient'" in line, line
            clients.setdefault(current, []).append((int(words[2]), float(words[-1])))
            continue
        current = int(words[1]) if words[0] == "round_start" else None
        hooks.append(line)
    return hooks, clients


def expected_clients(rounds: range, world_size: int, rank: int) -> dict[int, list[int]]:
    """Quickstart: 10 clients, 5 a round, seed 0, stateless FedAvg clients dealt round-robin."""
    return {r: clients_of_rank(sample_clients(0, r - 1, 10, 5), rank, world_size, stateful=False) for r in rounds}


def expected_hooks(first_round: int, last_round: int, eval_every: int, rounds: int) -> list[str]:
    lines = [f"fit_start {first_round - 1}"]
    for r in range(first_round, last_round + 1):
        lines += [f"round_start {r}", f"round_end {r} {r % eval_every == 0 or r == rounds}"]
    return lines + [f"fit_end {last_round}"]


@pytest.mark.slow
def test_hooks_fire_in_order_and_a_yaml_callback_interrupts_a_run_that_then_resumes(tmp_path):
    out_dir = tmp_path / "run"
    config = hooks_config(tmp_path,
                          {"class_path": "recording_callbacks.RecordHooks", "init_args": {"folder": str(tmp_path)}},
                          {"class_path": "recording_callbacks.StopAfterRound",
                           "init_args": {"round": 2, "final": False}})
    main(["fit", *TINY, "--federation.rounds", "5", "--config", config, "--out_dir", str(out_dir)])
    # Asked at the end of round 2, agreed at round 3's aggregation: the run stops after round 3.
    hooks, clients = recorded_hooks(tmp_path, 0)
    assert hooks == expected_hooks(1, 3, 2, 5)
    assert {r: [c for c, _ in pairs] for r, pairs in clients.items()} == expected_clients(range(1, 4), 1, 0)
    assert all(abs(sum(w for _, w in pairs) - 1) < 1e-3 for pairs in clients.values())
    assert [p.name for p in numbered_checkpoints(checkpoint_dir(out_dir))][-1] == "round_000003.ckpt"
    assert [row["round"] for row in read_metrics(out_dir)] == [1, 2, 3]

    (tmp_path / "hooks_rank0.txt").unlink()
    resumed_config = hooks_config(tmp_path, {"class_path": "recording_callbacks.RecordHooks",
                                             "init_args": {"folder": str(tmp_path)}})
    main(["fit", *TINY, "--federation.rounds", "5", "--config", resumed_config, "--out_dir", str(out_dir)])
    assert recorded_hooks(tmp_path, 0)[0] == expected_hooks(4, 5, 2, 5)
    assert [row["round"] for row in read_metrics(out_dir)] == [1, 2, 3, 4, 5]

    uninterrupted = tmp_path / "uninterrupted"
    main(["fit", *TINY, "--federation.rounds", "5", "--out_dir", str(uninterrupted)])
    resumed_model = torch.load(checkpoint_dir(out_dir) / "last.ckpt", weights_only=False)["model"]
    expected_model = torch.load(checkpoint_dir(uninterrupted) / "last.ckpt", weights_only=False)["model"]
    for name, tensor in expected_model.items():
        assert torch.equal(resumed_model[name], tensor), name


@pytest.mark.multiprocess
def test_hooks_fire_in_order_on_every_rank(tmp_path):
    config = hooks_config(tmp_path, {"class_path": "recording_callbacks.RecordHooks",
                                     "init_args": {"folder": str(tmp_path)}})
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SUPPORT), *sys.path])}
    environment = {k: v for k, v in environment.items() if not k.startswith("SLURM_")}
    completed = processes.run_ranks(
        [sys.executable, "-m", "fl_lightning", "fit", *TINY, "--federation.rounds", "3", "--config", config,
         "--fabric.devices", "2", "--fabric.process_group_timeout_s", "120", "--out_dir", str(tmp_path / "run")],
        env=environment, ranks=2, timeout=300,
    )
    assert [rank.returncode for rank in completed] == [0, 0], [rank.stderr for rank in completed]
    weights: dict[int, float] = {}
    for rank in (0, 1):
        hooks, clients = recorded_hooks(tmp_path, rank)
        assert hooks == expected_hooks(1, 3, 2, 3)
        assert {r: [c for c, _ in pairs] for r, pairs in clients.items()} == expected_clients(range(1, 4), 2, rank)
        for r, pairs in clients.items():
            weights[r] = weights.get(r, 0.0) + sum(w for _, w in pairs)
    assert all(abs(total - 1) < 1e-3 for total in weights.values())  # every client of a round, once


class StubLoop:
    def __init__(self):
        self.reasons, self.final = [], []

    def request_stop(self, reason: str, requeue: bool = False, final=None) -> None:
        self.reasons.append(reason)
        self.final.append(final)


@pytest.mark.parametrize("mode, values, stop_at", [
    ("max", [0.5, 0.6, 0.6, 0.59], 3),  # no improvement in the evaluations after 0.6
    ("min", [1.0, 0.9, 0.95, 0.8, 0.85], None),  # improves again before patience runs out
    ("max", [0.5, None, 0.5, None, 0.5], 4),  # rounds without the metric do not count
])
def test_early_stopping(mode, values, stop_at):
    callback, loop = EarlyStopping(metric="m", mode=mode, patience=2), StubLoop()
    asked_at = None
    for index, value in enumerate(values):
        callback.on_round_end(None, loop, {"round": index + 1, **({} if value is None else {"m": value})})
        if loop.reasons and asked_at is None:
            asked_at = index
    assert asked_at == stop_at
    assert all(loop.final)  # a decision: the run is over


def test_time_budget_stops_before_a_round_that_would_not_fit(monkeypatch):
    clock = iter([0.0, 0.0, 10.0, 20.0, 30.0, 40.0])
    monkeypatch.setattr("fl_lightning.callbacks.time.monotonic", lambda: next(clock))
    callback, loop = TimeBudget(max_seconds=45), StubLoop()
    callback.on_fit_start(None, loop)
    starts = []
    for round_index in range(5):
        callback.on_round_start(None, loop, round_index)
        starts.append(len(loop.reasons))
    # Rounds take 10 s: the round starting at 30 s ends at 40 s, and the next would end past 45 s.
    assert starts == [0, 0, 0, 1, 2]
    assert loop.final == [False, False]  # an interruption: the same command resumes the run


def test_a_resumed_time_budget_judges_its_first_round_by_the_longest_round_of_the_run(monkeypatch):
    clock = iter([1000.0, 1000.0, 1010.0, 2000.0, 2000.0])
    monkeypatch.setattr("fl_lightning.callbacks.time.monotonic", lambda: next(clock))
    first = TimeBudget(max_seconds=25)
    first.on_fit_start(None, StubLoop())
    for round_index in range(2):  # rounds of 10 s
        first.on_round_start(None, StubLoop(), round_index)
    state = first.state_dict()
    assert state == {"longest_round_seconds": 10.0}

    # A new process (a resume): with the run's longest round, two more rounds would end past its
    # budget, so it stops after its first; without the state it would not know.
    resumed, loop = TimeBudget(max_seconds=15), StubLoop()
    resumed.load_state_dict(state)
    resumed.on_fit_start(None, loop)
    resumed.on_round_start(None, loop, 2)
    assert loop.final == [False]


def configurable_classes():
    classes = list(SHORT_NAMES.values()) + [getattr(server_optimizers, name) for name in server_optimizers.__all__
                                            if name != "ServerOptimizer"]
    return classes + [CONST, EarlyStopping]


@pytest.mark.parametrize("cls", configurable_classes(), ids=lambda cls: cls.__name__)
def test_every_configurable_class_round_trips_through_its_written_config(cls):
    original = cls()
    written = _as_config(original)
    assert written["class_path"] == f"{cls.__module__}.{cls.__qualname__}"
    group = {"Algorithm": "algorithm", "ServerOptimizer": "server_optimizer", "Constraint": "constraint",
             "Callback": "callbacks"}[next(base.__name__ for base in cls.__mro__ if base.__name__ in
                                           ("Algorithm", "ServerOptimizer", "Constraint", "Callback"))]
    value = [written] if group == "callbacks" else written
    parser = build_parser()
    parsed = parser.instantiate(parser.parse_args(["fit", "--algorithm", "fl_lightning.algorithms.FedAvg", f"--{group}",
                                                   yaml.safe_dump(value, default_flow_style=True)])).fit[group]
    parsed = parsed[0] if group == "callbacks" else parsed
    assert type(parsed) is cls and parsed.init_args == original.init_args


def test_config_is_written_from_init_args_not_attribute_names():
    from fl_lightning.algorithms.base import Algorithm

    class Renamed(Algorithm):
        def __init__(self, mu: float = 0.5):
            self._weight = mu

    assert _as_config(Renamed(mu=0.25))["init_args"] == {"mu": 0.25}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr, bar", [(Terminal, True), (io.StringIO, False)], ids=["terminal", "redirected"])
def test_the_progress_bar_is_drawn_on_a_terminal_and_a_redirected_log_gets_lines(stderr, bar, monkeypatch, capsys):
    """A bar redraws itself with `\\r`: in a log file its frames would pile up on one line."""
    monkeypatch.setattr(sys, "stderr", stderr())
    fabric = types.SimpleNamespace(global_rank=0)
    loop = types.SimpleNamespace(rounds=2, start_round=0, history=[], failed=True)
    progress = ShowProgress(progress_bar=True)
    progress.on_fit_start(fabric, loop)
    progress.on_round_end(fabric, loop, {"round": 1, "train_loss": 0.5, "round_seconds": 0.1})
    progress.on_fit_end(fabric, loop)
    assert ("\r" in sys.stderr.getvalue()) == bar
    assert capsys.readouterr().out == ("" if bar else "round 1/2  train_loss 0.5000  0.10 s\n")
