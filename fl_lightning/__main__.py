"""The `fl-lightning` command (also `python -m fl_lightning`).

Stop signals are recorded from the first moment, before the heavy imports: Slurm's early signal
(`sbatch --signal=USR1@T`) may arrive while the process is still starting, and SIGUSR1's default
action would kill it with no checkpoint. Once the command is done they are ignored until the
process exits (see fl_lightning.cluster.StopSignals). OpenMP's wait policy is set then too, before
torch loads (fl_lightning.cpu.passive_wait_by_default).
"""

import gc

from fl_lightning.cluster import STOP_SIGNALS
from fl_lightning.cpu import passive_wait_by_default


def main() -> None:
    STOP_SIGNALS.hold_until_exit()
    passive_wait_by_default()
    try:
        from fl_lightning.commands.main import main as run_command

        run_command()
    finally:
        STOP_SIGNALS.ignore_until_exit()
        # The interpreter's shutdown would run the garbage collector, several times, over the half
        # million objects that torch, Lightning and the rest made on import: about 2.5 CPU s at the
        # end of every run and rank. The command's files are written and closed by now; what the exit
        # handlers still do (W&B's service) makes objects of its own, which are collected as usual.
        gc.freeze()


if __name__ == "__main__":
    main()
