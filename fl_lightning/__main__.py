"""The `fl-lightning` command (also `python -m fl_lightning`).

Stop signals are recorded from the first moment, before the heavy imports: Slurm's early signal
(`sbatch --signal=USR1@T`) may arrive while the process is still starting, and SIGUSR1's default
action would kill it with no checkpoint.
"""

from fl_lightning.cluster import STOP_SIGNALS


def main() -> None:
    STOP_SIGNALS.install()
    from fl_lightning.cli.main import main as run_command

    run_command()


if __name__ == "__main__":
    main()
