"""Downloads that many runs ask for at once, and `fl-lightning data`: one process downloads under the
lock of data.root while the others wait, a half-extracted folder is never read, a crashed or stopped
downloader blocks no one. The network is a local HTTP server that serves archives packed as the
published ones are (`fl_lightning.data.generate.write_archive`), each request held until the test
lets it through."""

import dataclasses
import functools
import os
import shutil
import signal
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import processes
import pytest
from paths import QUICKSTART
from torchvision.datasets.utils import calculate_md5

from fl_lightning.commands.main import main
from fl_lightning.data import datasets, download
from fl_lightning.data.datasets import LAYOUTS, check_dataset, load_dataset
from fl_lightning.data.generate import write_archive, write_cifar, write_tiny_imagenet
from fl_lightning.errors import ConfigError

HOLD_S = 120
ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "tiny_imagenet": "tiny-imagenet-200.zip"}
WRITERS = {"cifar10": lambda root: write_cifar(root, "cifar10", num_train=50, num_test=10),
           "tiny_imagenet": lambda root: write_tiny_imagenet(root)}
SIZES = {"cifar10": (50, 10), "tiny_imagenet": (12, 6)}
PROXIES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


class ArchiveServer:
    """The files of `folder` over HTTP on 127.0.0.1; each request waits until `gate` is set."""

    def __init__(self, folder: Path):
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[str] = []
        served = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self):
                served.requests.append(self.path)
                if served.gate.wait(HOLD_S):
                    try:
                        super().do_GET()
                    except (BrokenPipeError, ConnectionResetError):  # a client killed mid-download
                        pass

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{name}"

    def close(self) -> None:
        self.gate.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    for name in PROXIES:  # urllib would send even 127.0.0.1 through a proxy
        monkeypatch.delenv(name, raising=False)
    served = ArchiveServer(tmp_path / "served")
    yield served
    served.close()


def publish(server: ArchiveServer, tmp_path: Path, name: str, monkeypatch=None) -> tuple[str, str]:
    """Pack a small `name` dataset as its published archive and serve it; returns its URL and md5, which
    replace the real ones in LAYOUTS of this process when `monkeypatch` is given."""
    folder = WRITERS[name](tmp_path / "packed")
    archive = write_archive(folder, tmp_path / "served" / ARCHIVES[name])
    url, md5 = server.url(archive.name), calculate_md5(archive)
    if monkeypatch is not None:
        download_from(monkeypatch, name, url, md5)
    return url, md5


def download_from(monkeypatch, name: str, url: str, md5: str) -> None:
    monkeypatch.setitem(LAYOUTS, name, dataclasses.replace(LAYOUTS[name], url=url, md5=md5))


# A run's loading of one dataset, in a process of its own: data.download true, LAYOUTS pointed at the server.
LOADER = """
import dataclasses, sys
from fl_lightning.data.datasets import LAYOUTS, load_dataset
name, url, md5, root = sys.argv[1:]
LAYOUTS[name] = dataclasses.replace(LAYOUTS[name], url=url, md5=md5)
train, test = load_dataset(name, root, download=True)
print(f"loaded {len(train)} train and {len(test)} test images", flush=True)
"""


def start_loader(tmp_path: Path, index: int, name: str, url: str, md5: str, root: Path):
    """A LOADER process; returns it and the file its output goes to."""
    output = tmp_path / f"loader{index}.out"
    environment = {key: value for key, value in processes.threaded_environment().items() if key not in PROXIES}
    with open(output, "w") as file:
        process = processes.Popen([sys.executable, "-c", LOADER, name, url, md5, str(root)], env=environment,
                                  stdout=file, stderr=file)
    return process, output


def part_folders(root: Path) -> list[Path]:
    return sorted(root.glob(f".*{download.PART}*"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHIVES)
def test_concurrent_runs_wait_for_one_download(server, tmp_path, name):
    url, md5 = publish(server, tmp_path, name)
    root = tmp_path / "data"
    server.gate.clear()
    started = [start_loader(tmp_path, index, name, url, md5, root) for index in range(3)]
    loaders = [process for process, _ in started]

    def waiting() -> int:
        return sum("waiting for pid " in output.read_text() for _, output in started)

    processes.wait_until(lambda: server.requests and waiting() == 2, loaders,
                         "one download held and two runs waiting for its lock", HOLD_S)
    server.gate.set()
    for process in loaders:
        assert process.wait(HOLD_S) == 0, [output.read_text() for _, output in started]
    outputs = [output.read_text() for _, output in started]
    assert sum(f"downloading {url} into {root}" in text for text in outputs) == 1, outputs
    train, test = SIZES[name]
    assert all(f"loaded {train} train and {test} test images" in text for text in outputs), outputs
    assert check_dataset(name, root).state == "present" and part_folders(root) == []
    if name == "tiny_imagenet":  # decoded once, by the downloader, under the lock
        assert (root / LAYOUTS[name].folder / datasets.TINY_IMAGENET_CACHE).is_file()


def hold_a_download(server: ArchiveServer, tmp_path: Path, root: Path, monkeypatch):
    """A loader process holding the lock of root's CIFAR-10, its download held by the server; this
    process downloads the same archive."""
    url, md5 = publish(server, tmp_path, "cifar10", monkeypatch)
    server.gate.clear()
    holder, output = start_loader(tmp_path, 0, "cifar10", url, md5, root)
    processes.wait_until(lambda: bool(server.requests), [holder], "the download to start", HOLD_S)
    return holder, output


@pytest.mark.multiprocess
def test_a_killed_downloader_leaves_no_dataset_folder_and_blocks_no_one(server, tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    holder, _ = hold_a_download(server, tmp_path, root, monkeypatch)
    holder.kill()
    holder.wait(HOLD_S)
    assert not (root / "cifar-10-batches-py").exists() and len(part_folders(root)) == 1
    server.gate.set()

    train, _ = load_dataset("cifar10", root, download=True)
    assert len(train) == 50 and "waiting for" not in capsys.readouterr().out
    assert part_folders(root) == []  # the killed process's, removed


@pytest.mark.multiprocess
def test_a_stopped_downloader_is_taken_for_stale_and_the_download_goes_on_without_it(server, tmp_path, monkeypatch,
                                                                                  capsys):
    """A suspended job (SIGSTOP) keeps its lock but stops touching it; once it resumes, it finds the
    folder that the other process renamed into place and drops its own copy."""
    root = tmp_path / "data"
    holder, output = hold_a_download(server, tmp_path, root, monkeypatch)
    monkeypatch.setattr(download, "STALE_S", 0.2)
    monkeypatch.setattr(download, "POLL_S", 0.01)
    loaded = []
    # In a thread: were the holder not taken for stale, this would wait for it until it is resumed.
    waiter = threading.Thread(target=lambda: loaded.append(load_dataset("cifar10", root, download=True)))
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        server.gate.set()
        waiter.start()
        waiter.join(HOLD_S)
        captured = capsys.readouterr()
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        waiter.join()
    assert "waiting for pid " in captured.out and "going on without the lock" in captured.err
    assert len(loaded[0][0]) == 50
    assert holder.wait(HOLD_S) == 0, output.read_text()
    assert "loaded 50 train and 10 test images" in output.read_text()
    assert check_dataset("cifar10", root).state == "present" and part_folders(root) == []


def test_a_holder_touches_its_lock_file_while_it_holds_it(tmp_path, monkeypatch):
    """What tells a waiter that the holder still lives (the test above: what it sees when it does not)."""
    monkeypatch.setattr(download, "HEARTBEAT_S", 0.01)
    with download.DatasetLock(tmp_path / "data", "cifar-10-batches-py") as lock:
        written = lock.path.stat().st_mtime_ns
        processes.wait_until(lambda: lock.path.stat().st_mtime_ns != written, [], "a heartbeat", HOLD_S)
        assert lock.path.read_text().startswith(f"pid {os.getpid()} on ")


@pytest.mark.parametrize("damage, says", [("truncated", "that extracts whole"), ("changed", "with md5 ")])
def test_a_bad_archive_leaves_no_dataset_folder(server, tmp_path, monkeypatch, damage, says):
    publish(server, tmp_path, "cifar10", monkeypatch)
    archive = tmp_path / "served" / ARCHIVES["cifar10"]
    if damage == "truncated":
        archive.write_bytes(archive.read_bytes()[:len(archive.read_bytes()) // 2])
        monkeypatch.setitem(LAYOUTS, "cifar10", dataclasses.replace(LAYOUTS["cifar10"], md5=None))
    else:
        archive.write_bytes(archive.read_bytes() + b"\0")
    root = tmp_path / "data"
    with pytest.raises(ConfigError) as caught:
        load_dataset("cifar10", root, download=True)
    assert caught.value.field_name == "data.download" and says in str(caught.value)
    assert not (root / "cifar-10-batches-py").exists() and part_folders(root) == []


def test_a_partial_folder_is_refused_not_downloaded_over(server, tmp_path, monkeypatch):
    publish(server, tmp_path, "cifar10", monkeypatch)
    (write_cifar(tmp_path / "data", "cifar10", num_train=50, num_test=10) / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match=r"lacks data_batch_3 \(data.download does not replace a folder") as caught:
        load_dataset("cifar10", tmp_path / "data", download=True)
    assert caught.value.field_name == "data.root" and server.requests == []


def test_a_data_root_the_lock_cannot_be_made_in_is_one_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError) as caught:
        load_dataset("cifar10", tmp_path / "a_file" / "data", download=True)
    assert str(caught.value) == (
        "data.root: expected a folder this process can create and write (for the lock of a dataset's download and "
        f"decoding), got '{tmp_path}/a_file/data (Not a directory)'")


def write_plan(tmp_path: Path, datasets: dict[str, str]) -> Path:
    """A plan over datasets, setting name -> its data settings (a YAML flow mapping), for two seeds each."""
    axis = "".join(f"    {name}: [{settings}]\n" for name, settings in datasets.items())
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"name: datasets\nconfigs: [{QUICKSTART}]\nmethods: {{FedAvg: [{{algorithm: fedavg}}]}}\n"
                    f"settings:\n  dataset:\n{axis}seeds: [0, 1]\n")
    return plan


def test_data_of_a_plan_prints_each_dataset_once(tmp_path, cifar_root, capsys):
    plan = write_plan(tmp_path, {"digits": "{data.name: digits}",
                                 "cifar10": f"{{data.name: cifar10, data.root: {cifar_root}}}"})
    main(["data", str(plan)])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "digits: bundled with fl-lightning (digits.npz): 1437 train and 360 test images of 1x8x8, 10 classes",
        f"cifar10: {cifar_root}/cifar-10-batches-py/ holds data_batch_1..5 and test_batch (CIFAR-10, python version): "
        f"layout OK; 240 train and 60 test images of 3x32x32, 10 classes; {lines[-1].split('; ')[-1]}",
    ]
    assert lines[1].endswith(" MB on disk")


def test_data_of_a_fit_line_reads_tiny_imagenet_from_its_cache_alone(tmp_path, capsys):
    folder = write_tiny_imagenet(tmp_path / "data")
    fit_line = ["data", "--config", QUICKSTART, "--data.name", "tiny_imagenet", "--data.root", str(tmp_path / "data")]
    main(fit_line)
    assert "holds wnids.txt, train/<wnid>/images/*.JPEG and val/ with val_annotations.txt: layout OK; 12 train and " \
           "6 test images of 3x64x64, 3 classes; " in capsys.readouterr().out
    for part in ("train", "val"):
        shutil.rmtree(folder / part)
    main(fit_line)
    assert capsys.readouterr().out.startswith(
        f"tiny_imagenet: {folder}/ holds its decoded images (fl_lightning_cache.pt), without the JPEG layout; 12 "
        "train and 6 test images of 3x64x64, 3 classes; ")


def test_data_downloads_a_plans_dataset_with_an_override(server, tmp_path, monkeypatch, capsys):
    publish(server, tmp_path, "cifar10", monkeypatch)
    root = tmp_path / "fetched"
    plan = write_plan(tmp_path, {"cifar10": f"{{data.name: cifar10, data.root: {root}}}"})
    main(["data", str(plan), "--override", "data.download=true"])
    out = capsys.readouterr().out
    assert out.count(f"downloading {LAYOUTS['cifar10'].url} into {root}") == 1
    assert "50 train and 10 test images of 3x32x32" in out and check_dataset("cifar10", root).state == "present"


@pytest.mark.slow
def test_data_refuses_a_missing_dataset_in_the_line_fit_gives_before_downloading(server, tmp_path, monkeypatch,
                                                                               capsys):
    """A fit line's dataset is refused as fit refuses it; of a plan's two datasets, the one missing
    without download stops the command before the other is downloaded."""
    publish(server, tmp_path, "cifar10", monkeypatch)
    missing = tmp_path / "nowhere"
    fit_line = ["--config", QUICKSTART, "--data.name", "cifar100", "--data.root", str(missing)]
    plan = write_plan(tmp_path, {"cifar10": f"{{data.name: cifar10, data.root: {tmp_path / 'fetched'}, "
                                            "data.download: true}",
                                 "cifar100": f"{{data.name: cifar100, data.root: {missing}}}"})
    refusals = []
    for argv in (["data", *fit_line], ["fit", *fit_line, "--out_dir", str(tmp_path / "run")], ["data", str(plan)]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        refusals.append(capsys.readouterr().err)
    assert refusals == 3 * [
        f"error: data.root: expected {missing}/cifar-100-python/ to hold train and test (CIFAR-100, python version) "
        f"(or set data.download: true), got '{missing}'\n"]
    assert server.requests == []
