"""What every diagnostic shares: a schedule, and one reduction across ranks on its rounds only."""

from __future__ import annotations

import torch

from fl_lightning.callbacks import Callback


class Diagnostic(Callback):
    """A callback measured every `every` rounds (and after the last round).

    The diagnostics here keep what they sum only within a round, and checkpoints fall between
    rounds, so none has state to save (an empty `state_dict`); one that kept something across
    rounds would save it as any callback does (see fl_lightning.callbacks). A resumed run may
    measure at another cadence; the other arguments choose what is measured, and stay."""

    safe_to_change = ("every",)

    def __init__(self, every: int = 1):
        if every < 1:
            from fl_lightning.errors import ConfigError

            raise ConfigError(f"callbacks.{type(self).__name__}.every", "an integer >= 1", every)
        self.every = every

    def due(self, loop, round_number: int) -> bool:
        """Whether the round numbered `round_number` (1-based) is measured."""
        return round_number % self.every == 0 or round_number == loop.rounds

    @staticmethod
    def sum_over_ranks(engine, values: torch.Tensor) -> torch.Tensor:
        """One all-reduce(sum) of a flat tensor (nothing on a single rank): a diagnostic's own
        reduction, made only on the rounds it measures."""
        return engine.all_reduce(values, reduce_op="sum") if engine.world_size > 1 else values
