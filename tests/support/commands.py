"""The command line run in the test's own process, its output read through pytest's capsys."""

from fl_lightning.commands.main import main as fl_lightning_main


def run_sweep(capsys, *arguments: str) -> tuple[int, str, str]:
    """`fl-lightning sweep ...` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        fl_lightning_main(["sweep", *arguments])
        status = 0
    except SystemExit as exited:
        status = exited.code or 0
    out, err = capsys.readouterr()
    return status, out, err
