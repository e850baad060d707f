"""`fl-lightning` processes for the tests, started without paying the imports each time.

A fresh Python that imports fl_lightning and Lightning costs about 8 CPU seconds before it trains
anything (torch, torchmetrics -> torchvision -> torch._dynamo, wandb), several times what
the tests' tiny runs cost. Here every process is a fork of one forkserver
(`multiprocessing.get_context("forkserver")`), a fresh single-threaded Python that has imported
those modules once. The pytest process itself is never forked: torch uses GNU libgomp, and a fork
of a process that has run multi-threaded torch ops hangs as soon as it uses two threads; the
forkserver never runs a torch op.

Each child is set up as a fresh process of the same command line would be: its own session and
process group (what `start_new_session=True` gives, and what lets a kill of its group spare the
forkserver and pytest), the test's environment (plus what the imports set in it, as they would have
in a fresh process), torch's thread count read from OMP_NUM_THREADS, stdout and stderr on the
test's files or pipes, sys.argv, the working directory and PYTHONPATH first on sys.path; then
`-m MODULE` runs as `python -m` would, `-c CODE` as `python -c`, and it exits as the interpreter
would: non-daemon threads joined, atexit handlers run, output flushed, the exit status of SystemExit
(1 and a traceback for an uncaught exception); a signal death reads as -N, as with subprocess.

`Popen` and `run` have the parts of subprocess's interface the tests use. `run_ranks` and
`call_on_ranks` start the ranks of one node this way, as Fabric's own launcher starts the ranks after
the first (then Fabric starts none itself), instead of a fresh interpreter for each; a sweep in a
child started with `fork_runs=True` starts its runs as forks of the same server. The children are
children of the forkserver, not of pytest: their exit status comes through multiprocessing's
sentinel, and nothing that needs the parent (waitpid, RUSAGE_CHILDREN) applies. The tests about
the real start-up path (a signal while the interpreter imports, a bad input in a real process,
signals during the interpreter's own shutdown) keep launching fresh interpreters with subprocess.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import forkserver, reduction
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

# What a `fit` imports, up front or on its way: everything the forkserver imports, no child pays.
PRELOADED_MODULES = [
    "fl_lightning.commands.main", "fl_lightning.federation", "fl_lightning.module", "fl_lightning.federation.trainer",
    "fl_lightning.federation.groups", "fl_lightning.federation.client_paths", "lightning.fabric", "lightning.pytorch",
    "torchmetrics", "torchvision", "torch._dynamo", "torch._inductor", "torch.utils.serialization",
    "matplotlib.pyplot", "matplotlib.backends.backend_agg", "PIL.JpegImagePlugin", "PIL.features",
    "attrs", "docstring_parser", "requests",
    # W&B's, as far as `wandb.init` in offline mode and `wandb.teardown` go.
    "wandb", "wandb.sdk", "wandb.sdk.launch", "wandb.apis.public", "wandb.docker", "wandb._analytics",
    "opentelemetry.sdk.metrics", "opentelemetry.sdk.trace", "opentelemetry.sdk.resources", "opentelemetry.sdk._logs",
    "opentelemetry.exporter.otlp",
]
# The forkserver's own environment: the children's thread count, so that its libgomp starts as theirs.
SERVER_ENVIRONMENT = {"OMP_NUM_THREADS": "1"}

_server_environment: Optional[dict[str, str]] = None
_started: list["Popen"] = []


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started with the environment recorded for the children."""
    global _server_environment
    context = multiprocessing.get_context("forkserver")
    if _server_environment is None:
        context.set_forkserver_preload(PRELOADED_MODULES)
        saved = {name: os.environ.get(name) for name in SERVER_ENVIRONMENT}
        os.environ.update(SERVER_ENVIRONMENT)
        try:
            forkserver.ensure_running()
            _server_environment = dict(os.environ)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
    return context


class _FdForChild:
    """A file descriptor handed to the child: pickled while multiprocessing starts it, it travels
    to the forkserver with the process (reduction.DupFd) and arrives as the child's own fd."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def _child(command: list[str], environment: dict[str, str], cwd: str, stdout: int, stderr: int,
           server_environment: dict[str, str], fork_runs: bool) -> None:
    """The forked child: becomes what a fresh interpreter of `command` would be, runs it, exits."""
    import io
    import runpy

    os.setsid()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr} - {1, 2}:
        os.close(fd)
    # Non-interactive stdout is block-buffered, stderr line-buffered, as in a fresh interpreter.
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors="strict")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", line_buffering=True)
    # Variables the imports set (torch, Lightning) would be there in a fresh process too, unless given.
    set_by_imports = {name: value for name, value in os.environ.items() if server_environment.get(name) != value}
    os.environ.clear()
    os.environ.update({**set_by_imports, **environment})
    os.chdir(cwd)
    # What a fresh interpreter puts first on sys.path: the working directory for -m ('' for -c), then PYTHONPATH.
    python_path = [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:0] = [cwd if command[1] == "-m" else "", *python_path]
    import torch  # imported by the server, before OMP_NUM_THREADS was the child's

    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    if fork_runs:
        _fork_runs_from_the_server(server_environment)

    status = 0
    try:
        if command[1] == "-m":
            sys.argv = [command[2], *command[3:]]
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        elif command[1] == "-c":
            sys.argv = ["-c", *command[3:]]
            exec(compile(command[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            raise ValueError(f"expected `python -m MODULE ...` or `python -c CODE ...`, got {command[:2]}")
    except SystemExit as exited:
        if exited.code is None:
            status = 0
        elif isinstance(exited.code, int):
            status = exited.code
        else:
            print(exited.code, file=sys.stderr)
            status = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    # The interpreter's way out: wait for non-daemon threads, then the atexit handlers, then flush.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _fork_runs_from_the_server(server_environment: dict[str, str]) -> None:
    """In a child: a sweep it runs starts its runs as forks of the forkserver this child was forked
    from (the product's start_run_process replaced, as `conftest.forked_runs` does in pytest's
    process), never of the child itself, whose state its own command has changed. multiprocessing
    gives a forkserver's children the server's address and their share of its liveness pipe, which is
    all a request needs; its ensure_running, which would start another server in a process that is
    not the server's parent, is skipped."""
    global _server_environment
    from fl_lightning.experiments.sweeps import local

    server = forkserver._forkserver
    if server._forkserver_address is None or server._forkserver_alive_fd is None:
        raise RuntimeError("fork_runs: this Python's forkserver gives its children no address to fork from")
    _server_environment = server_environment
    server.ensure_running = lambda: None
    local.start_run_process = start_run_process


Destination = Union[None, int, IO]


class Popen:
    """A forked `python -m MODULE ...` or `python -c CODE ...` (command[0], the interpreter, is
    this one), with subprocess.Popen's pid, poll, wait, send_signal, kill, returncode, and stdout
    and stderr as text streams when given subprocess.PIPE (stderr=subprocess.STDOUT: where stdout goes)."""

    def __init__(self, command: list[str], env: Optional[dict[str, str]] = None, stdout: Destination = None,
                 stderr: Destination = None, cwd: Optional[Union[str, os.PathLike]] = None, fork_runs: bool = False):
        """fork_runs: a sweep in the child starts its runs as forks too, not as fresh interpreters."""
        environment = dict(os.environ if env is None else env)
        if "OMP_NUM_THREADS" not in environment:
            # torch read its default thread count in the server; a child could only guess a fresh one's.
            raise ValueError("a forked process needs OMP_NUM_THREADS in its environment")
        context = _context()
        self.args = list(command)
        self.stdout: Optional[IO[str]] = None
        self.stderr: Optional[IO[str]] = None
        child_ends, own_copies = [], []
        for name, destination, inherited in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if destination == subprocess.STDOUT:
                child_ends.append(child_ends[0])
            elif destination == subprocess.PIPE:
                read_end, write_end = os.pipe()
                setattr(self, name, open(read_end, "r"))
                child_ends.append(write_end)
                own_copies.append(write_end)
            elif destination is None:
                child_ends.append(inherited)
            elif isinstance(destination, int):
                child_ends.append(destination)
            else:
                child_ends.append(destination.fileno())
        self._process = context.Process(
            target=_child, name="fl-lightning",
            args=(self.args, environment, os.fspath(cwd or os.getcwd()), _FdForChild(child_ends[0]),
                  _FdForChild(child_ends[1]), _server_environment, fork_runs),
        )
        try:
            self._process.start()
        finally:
            for fd in own_copies:
                os.close(fd)
        self.pid: int = self._process.pid
        _started.append(self)

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to the child's whole process group (it and what it started, W&B's service)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group leader
                self.send_signal(signal.SIGKILL)


def threaded_environment() -> dict[str, str]:
    """This process's environment, with the OMP_NUM_THREADS a forked process needs: one thread
    unless the caller's environment sets it."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def start_run_process(command: list[str], environment: dict[str, str], log: Optional[IO[bytes]],
                      cpus: Optional[list[int]] = None) -> Popen:
    """What `fl_lightning.experiments.sweeps.local.start_run_process` starts, forked: the `conftest.forked_runs`
    fixture has a sweep in the test's own process start its runs this way. Not bound to `cpus`: a forked
    run takes its threads from OMP_NUM_THREADS."""
    return Popen(command, env=environment, stdout=log, stderr=None if log is None else subprocess.STDOUT)


def run(command: list[str], env: Optional[dict[str, str]] = None, timeout: Optional[float] = None,
        cwd: Optional[Union[str, os.PathLike]] = None) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout) in a forked child."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = Popen(command, env=env, stdout=stdout, stderr=stderr, cwd=cwd)
        try:
            status = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(command, status, _captured(stdout), _captured(stderr))


def _captured(output: IO[bytes]) -> str:
    """What a child wrote to `output` (a temporary file), as text: bytes that are no text do not fail."""
    output.seek(0)
    return output.read().decode(errors="replace")


def wait_until(condition: Callable[[], bool], running: list, what: str, timeout: float) -> None:
    """Poll `condition` until it holds; fail, naming `what`, if one of the `running` processes
    (subprocess's or this module's Popen) exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [process for process in running if process.poll() is not None]
        if ended:
            raise AssertionError(f"{ended[0].args[:4]} exited {ended[0].returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_environments(environment: dict[str, str], ranks: int) -> list[dict[str, str]]:
    """The environment of each rank of one node, with what Fabric's launcher gives the ranks it starts
    (lightning.fabric.strategies.launchers.subprocess_script): with LOCAL_RANK set, Fabric takes
    the ranks as started for it, as under torchrun."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0",
              "WORLD_SIZE": str(ranks)}
    return [{**environment, **launch, "LOCAL_RANK": str(rank)} for rank in range(ranks)]


def run_ranks(command: list[str], env: dict[str, str], ranks: int, timeout: float) -> list[subprocess.CompletedProcess]:
    """`run(command)` on each of `ranks` ranks of one node at once (`command` asks Fabric for that
    many devices); each rank's result, in rank order. Ranks still running after `timeout` seconds
    are killed, and the error holds every rank's output."""
    started = []
    for environment in rank_environments(env, ranks):
        outputs = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        started.append((Popen(command, env=environment, stdout=outputs[0], stderr=outputs[1]), outputs))
    deadline = time.monotonic() + timeout
    timed_out = False
    for process, _ in started:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            process.kill()
            process.wait()
    results = []
    for process, outputs in started:
        with outputs[0] as stdout, outputs[1] as stderr:
            results.append(subprocess.CompletedProcess(command, process.returncode, _captured(stdout),
                                                       _captured(stderr)))
    if timed_out:
        logs = "\n".join(f"--- rank {rank} (exit {result.returncode}):\n{result.stdout}{result.stderr}"
                         for rank, result in enumerate(results))
        raise AssertionError(f"ranks still running after {timeout} s were killed:\n{logs}")
    return results


# A rank of `call_on_ranks`: argv is the pickled call and the file for rank 0's return value, saved
# with the size of every process group the call formed.
_CALL = """
import os, pickle, sys, torch
function, kwargs = pickle.loads(open(sys.argv[1], "rb").read())
formed, init_process_group = [], torch.distributed.init_process_group

def recorded(*args, **kwargs):
    init_process_group(*args, **kwargs)
    formed.append(torch.distributed.get_world_size())

torch.distributed.init_process_group = recorded
result = function(**kwargs)
if os.environ["LOCAL_RANK"] == "0":
    torch.save((result, formed), sys.argv[2])
"""


def call_on_ranks(ranks: int, function: Callable[..., Any], timeout: float = 300, **kwargs) -> Any:
    """`function(**kwargs)` on `ranks` ranks of one node (its FabricArgs ask for that many devices),
    each a forked process; rank 0's return value, once the call has formed one process group of
    `ranks` (not a run of its own on each). The call travels pickled, so the ranks share no tensor
    memory with each other or with the caller."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        call, returned = Path(folder) / "call.pkl", Path(folder) / "returned.pt"
        call.write_bytes(pickle.dumps((function, kwargs)))
        results = run_ranks([sys.executable, "-c", _CALL, str(call), str(returned)], threaded_environment(), ranks,
                            timeout)
        failed = [f"rank {rank} exited {result.returncode}:\n{result.stderr}" for rank, result in enumerate(results)
                  if result.returncode != 0]
        assert not failed, "\n".join(failed)
        result, formed = torch.load(returned, weights_only=False)
    assert formed == [ranks], f"the call formed process groups of sizes {formed}, not one of {ranks}"
    return result


@atexit.register
def shut_down() -> None:
    """Kill the children still running (a failed test's) and stop the forkserver, waiting for it, so
    that its children's CPU time counts in this process's (RUSAGE_CHILDREN, what `time` reports), as
    a subprocess's does. The end of the test session calls it (tests/conftest.py); the exit handler
    is the fallback, and runs before multiprocessing's own, which would wait for the leftovers.
    The forkserver is killed rather than asked to exit: its children are reaped by then, and its
    own interpreter shutdown, with everything it imported, could take longer than pytest-xdist
    gives a worker to exit."""
    global _server_environment
    for process in _started:
        process.kill()
    for process in _started:
        process.wait()
    _started.clear()
    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()  # reaps it, and forgets it: a later process starts a new one
    _server_environment = None
