"""SLURM and preemption: signal handling, requeue, and checks against the allocation."""
# Placeholder interface; implemented in full alongside the sbatch scripts.

from __future__ import annotations

from typing import Optional


class PreemptionHandler:
    def __init__(self, signal_name: Optional[str]):
        self.requested = False

    def requeue(self) -> None:
        pass

    def restore(self) -> None:
        pass


def check_slurm_allocation(fabric_args) -> None:
    pass


def check_signal_name(signal_name: Optional[str]) -> None:
    pass
