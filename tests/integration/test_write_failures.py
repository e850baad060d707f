"""A run whose files cannot be written (a full disk, a read-only folder) ends in one `error:` line
naming the file, the cause, the last good checkpoint and the same command to run again, with exit
status 74; what it saved is whole, no temporary file is left, and the same command, once the cause is
put right, ends with the model of an uninterrupted run.

A real small file system (tmpfs) and real read-only folders where this machine allows them (mounts
need root; a non-root user's read-only folder is a plain chmod); everywhere, the same failures
raised at the write of each file a run writes."""

import errno
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import wandb
from paths import QUICKSTART

from fl_lightning import atomic_files, run_logging
from fl_lightning.checkpoint import checkpoint_dir, load_checkpoint, numbered_checkpoints
from fl_lightning.commands.main import main
from fl_lightning.run_dir import PARTITION_PLOT
from fl_lightning.run_logging import METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow  # end to end: each test trains runs in this process
ROUNDS = 8
WRITE_FAILED = 74


def run_command(out_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--logger.progress_bar",
            "false", "--federation.rounds", str(ROUNDS), "--federation.local_steps", "2", "--federation.eval_every",
            "4", "--checkpoint.every", "1", "--checkpoint.keep", "3", "--callbacks",
            '[{class_path: recording_callbacks.FillTheDisk, init_args: {round: 6}}]', "--out_dir", str(out_dir),
            *extra]


def failed_run(capsys, command: list[str]) -> list[str]:
    """Runs `command`, which must fail to write; the lines of its stderr, whose last (and only
    `error:` line) says so. A resume says first which checkpoint it resumes from."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(command)
    stderr = capsys.readouterr().err
    assert exited.value.code == WRITE_FAILED, stderr
    lines = stderr.splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], stderr
    assert lines[-1].startswith("error: cannot write ") and "Traceback" not in stderr, stderr
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("reference") / "run"
    main(run_command(out_dir))
    return out_dir


def assert_resumes_to_the_reference(command: list[str], out_dir: Path, reference: Path) -> None:
    """What the failed run left is whole: no temporary file, every checkpoint loads; the same command
    then ends with the reference's rows and, bitwise, its model."""
    assert [path for path in out_dir.rglob("*") if path.name.endswith(".tmp")] == []
    for path in numbered_checkpoints(checkpoint_dir(out_dir)):
        load_checkpoint(path)
    main(command)
    assert [row["round"] for row in read_metrics(out_dir)] == list(range(1, ROUNDS + 1))
    final, expected = (load_checkpoint(checkpoint_dir(run) / "last.ckpt")["model"] for run in (out_dir, reference))
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs; skipped where this process may not mount one (not root, or a container that
    forbids mounts)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not can_mount() or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                         capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and a machine that allows mounts")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


# With W&B, whose service cannot write the run's file either: the run does not wait for it (or warn).
@pytest.mark.parametrize("wandb_mode", ["disabled", "offline"])
def test_a_disk_full_at_round_6_is_one_line_and_the_same_command_resumes_once_space_is_freed(
        wandb_mode, small_disk, reference, capsys):
    out_dir = small_disk / "run"
    (small_disk / "fill").touch()
    folder = checkpoint_dir(out_dir)
    command = run_command(out_dir, "--logger.wandb_mode", wandb_mode)
    assert failed_run(capsys, command) == [
        f"error: cannot write {folder / 'round_000006.ckpt'} (No space left on device); the last good checkpoint is "
        f"{folder / 'round_000005.ckpt'}: free space on its file system, then run the same command again to resume "
        "from round 5"]
    # Still full: the rerun cannot write the first file it writes.
    assert failed_run(capsys, command)[-1].startswith(f"error: cannot write {out_dir / 'config.yaml'} (")
    (small_disk / "filler").unlink()
    assert_resumes_to_the_reference(command, out_dir, reference)


class ReadOnly:
    """Makes a folder read-only for this process, for real: a read-only bind mount as root (whom
    permissions do not stop), a chmod otherwise."""

    def __init__(self):
        self.undo = []

    @property
    def cause(self) -> tuple[str, str]:
        """What the error line says of a write into such a folder: the error, and what to do."""
        if os.geteuid() == 0:
            return "Read-only file system", "make its folder writable (its file system is mounted read-only)"
        return "Permission denied", "make its folder writable"

    def make(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            folder.chmod(0o555)
            self.undo.append(lambda: folder.chmod(0o755))
            return
        if not can_mount() or subprocess.run(["mount", "--bind", str(folder), str(folder)]).returncode != 0:
            pytest.skip("a folder read-only for root needs a read-only bind mount, which this machine forbids")
        self.undo.append(lambda: subprocess.run(["umount", str(folder)], check=True))
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)

    def make_writable(self) -> None:
        while self.undo:
            self.undo.pop()()


@pytest.fixture
def read_only():
    folders = ReadOnly()
    yield folders
    folders.make_writable()


@pytest.mark.parametrize("folder", ["checkpoints", "wandb"])
def test_a_read_only_folder_of_the_run_is_one_line_and_the_same_command_resumes_once_writable(
        folder, read_only, reference, tmp_path, capsys):
    out_dir = tmp_path / "run"
    command = run_command(out_dir, "--logger.wandb_mode", "offline" if folder == "wandb" else "disabled")
    if folder == "checkpoints":  # the run saved two checkpoints before its folder became read-only
        main([*command, "--federation.rounds", "2"])
    read_only.make(out_dir / folder)
    line = failed_run(capsys, command)[-1]
    error, remedy = read_only.cause
    if folder == "checkpoints":
        folder_path = checkpoint_dir(out_dir)
        assert line == (f"error: cannot write {folder_path / 'round_000003.ckpt'} ({error}); the last good checkpoint "
                        f"is {folder_path / 'round_000002.ckpt'}: {remedy}, then run the same command again to resume "
                        "from round 2")
    else:  # W&B names the folder of its run, which it could not make
        assert line.startswith(f"error: cannot write {out_dir / 'wandb'}/offline-run-"), line
        assert line.endswith(f" ({error}); no checkpoint was saved yet: {remedy}, then run the same command again to "
                             "start the run"), line
    read_only.make_writable()
    assert_resumes_to_the_reference(command, out_dir, reference)


def enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def eacces(path) -> OSError:
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def failing_open(monkeypatch, module, fails, error) -> None:
    """`open` in `module` raises `error(path)` for a path for which `fails(path, mode)` holds."""
    def opened(path, mode="r", *args, **kwargs):
        if fails(Path(path), mode):
            raise error(path)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", opened, raising=False)


def fill_at_the_checkpoint_of_round_3(monkeypatch, out_dir: Path) -> None:
    failing_open(monkeypatch, atomic_files, lambda path, mode: path.name.startswith(".round_000003.ckpt."), enospc)


def fill_at_the_third_append_to_metrics(monkeypatch, out_dir: Path) -> None:
    appends = itertools.count(1)
    failing_open(monkeypatch, run_logging,
                 lambda path, mode: path.name == METRICS_FILE and mode == "a" and next(appends) == 3, enospc)


def deny_partition_png(monkeypatch, out_dir: Path) -> None:
    failing_open(monkeypatch, atomic_files, lambda path, mode: path.name.startswith(f".{PARTITION_PLOT}."), eacces)


def deny_the_wandb_folder(monkeypatch, out_dir: Path) -> None:
    def init(**arguments):
        raise eacces(out_dir / "wandb" / "offline-run-x")

    monkeypatch.setattr(wandb, "init", init)


INJECTED = {
    # what fails: (the failure, the file the error line names, the round the same command resumes from)
    "checkpoint": (fill_at_the_checkpoint_of_round_3, "checkpoints/round_000003.ckpt", 2),
    "metrics.jsonl": (fill_at_the_third_append_to_metrics, METRICS_FILE, 3),
    "partition.png": (deny_partition_png, PARTITION_PLOT, None),
    "wandb": (deny_the_wandb_folder, "wandb/offline-run-x", None),
}


@pytest.mark.parametrize("fail, named, resumed", INJECTED.values(), ids=INJECTED.keys())
def test_a_write_that_fails_is_one_line_naming_the_file_and_the_same_command_resumes(
        fail, named, resumed, reference, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "run"
    command = run_command(out_dir, "--logger.wandb_mode", "offline" if named.startswith("wandb") else "disabled")
    with monkeypatch.context() as failing:
        fail(failing, out_dir)
        lines = failed_run(capsys, command)
    if resumed is None:
        expected = f"cannot write {out_dir / named} (Permission denied); no checkpoint was saved yet: make its " \
                   "folder writable, then run the same command again to start the run"
    else:
        expected = f"cannot write {out_dir / named} (No space left on device); the last good checkpoint is " \
                   f"{checkpoint_dir(out_dir) / f'round_{resumed:06d}.ckpt'}: free space on its file system, then " \
                   f"run the same command again to resume from round {resumed}"
    assert lines == [f"error: {expected}"]
    assert_resumes_to_the_reference(command, out_dir, reference)
