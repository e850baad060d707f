"""What every diagnostic shares: a schedule, one reduction across ranks on its rounds only, and the
count of the passes through the model it runs, apart from the method's (`cost_*`) counters."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fl_lightning.callbacks import Callback

DIAG_FORWARD_PASSES, DIAG_GRAD_EVALS = "diag_forward_passes", "diag_grad_evals"
DIAG_COUNTERS = (DIAG_FORWARD_PASSES, DIAG_GRAD_EVALS)
"""The keys of a round's metrics row that count the passes the diagnostics ran up to the end of that
round, all of them together and on all ranks: measurement, never part of the method's cost."""

HVP_PASSES = 2
"""A Hessian-vector product counted as what it costs: two gradient evaluations, each a forward and a
backward pass (forward-over-reverse carries a tangent through one forward and one backward pass; the
double backward runs a backward pass through the graph of a forward and a backward)."""


class Diagnostic(Callback):
    """A callback measured every `every` rounds (and after the last round).

    Its passes through the model are counted where it runs them (`count_passes`), on the rank that ran
    them; they ride in the measured round's one reduction (`reduced`), so the totals are the
    same on every rank and for any number of ranks. The totals are cumulative over the run, added to
    every round's row (`DIAG_COUNTERS`, summed over the run's diagnostics) and saved with the
    checkpoint (`state_dict`), so a resumed run counts on exactly. What a diagnostic sums within a
    round is not saved: checkpoints fall between rounds. A resumed run may measure at another
    cadence; the other arguments choose what is measured, and stay."""

    safe_to_change = ("every",)

    def __init__(self, every: int = 1):
        if every < 1:
            from fl_lightning.errors import ConfigError

            raise ConfigError(f"callbacks.{type(self).__name__}.every", "an integer >= 1", every)
        self.every = every
        self.passes = dict.fromkeys(DIAG_COUNTERS, 0)  # the run's, over all ranks
        self._round_passes = [0, 0]  # this rank's in the current round: forward, backward

    def due(self, loop, round_number: int) -> bool:
        """Whether the round numbered `round_number` (1-based) is measured."""
        return round_number % self.every == 0 or round_number == loop.rounds

    def count_passes(self, forward: int, backward: int) -> None:
        """Counts passes through the model this rank ran for the diagnostic in this round."""
        self._round_passes[0] += forward
        self._round_passes[1] += backward

    def read_uploads(self, loop, client, uploads: Mapping) -> Mapping:
        """`uploads` as the diagnostic reads them. On the grouped path a fused client's own uploads
        are computed again, alone, on first reading (`fuses_clients`): the passes of its local steps,
        counted as the diagnostic's that first reads them."""
        return CountedUploads(self, loop, client, uploads) if not getattr(uploads, "computed", True) else uploads

    def on_round_start(self, engine, loop, round_index: int) -> None:
        self._round_passes = [0, 0]  # nothing left over from a round that failed before its end

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if self.due(loop, metrics["round"]):
            self.measured(engine, loop, metrics)
        for key in DIAG_COUNTERS:
            metrics[key] = metrics.get(key, 0) + self.passes[key]

    def measured(self, engine, loop, metrics: dict) -> None:
        """Adds the measured round's values to its `metrics` row."""

    @staticmethod
    def sum_over_ranks(engine, values: torch.Tensor) -> torch.Tensor:
        """One all-reduce(sum) of a flat tensor (nothing on a single rank)."""
        return engine.all_reduce(values, reduce_op="sum") if engine.world_size > 1 else values

    def reduced(self, engine, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the ranks: the diagnostic's own reduction, made only on the rounds it
        measures, carrying this rank's passes of the round as two more numbers, added to the run's."""
        dtype = torch.promote_types(values.dtype, torch.float32)  # counts exact to 2^24 a round, also for bf16
        passes = torch.tensor(self._round_passes, dtype=dtype, device=values.device)
        self._round_passes = [0, 0]
        total = self.sum_over_ranks(engine, torch.cat([values.to(dtype), passes]))
        for key, count in zip(DIAG_COUNTERS, total[-2:].tolist()):
            self.passes[key] += round(count)
        return total[:-2].to(values.dtype)

    def state_dict(self) -> dict:
        # None while it ran no pass: a diagnostic that reads only the uploads stays stateless, and may
        # be left out of a resumed run.
        return {"passes": dict(self.passes)} if any(self.passes.values()) else {}

    def load_state_dict(self, state: dict) -> None:
        self.passes = dict(state["passes"])


class CountedUploads(Mapping):
    """A fused client's own uploads, not computed yet, whose computation is counted as the passes of
    its local steps to the diagnostic that first reads them."""

    def __init__(self, diagnostic: Diagnostic, loop, client, uploads: Mapping):
        self._diagnostic, self._loop, self._client, self._uploads = diagnostic, loop, client, uploads

    def _read(self) -> Mapping:
        if not self._uploads.computed:
            passes = self._loop.algorithm.step_passes(True)  # a fused rule is stateless: alike every round
            steps = self._client.num_steps
            self._diagnostic.count_passes(passes.forward * steps, passes.backward * steps)
        return self._uploads

    def __getitem__(self, name: str):
        return self._read()[name]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())
