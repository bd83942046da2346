"""Shared helpers: runs with real processes on the CPU (gloo), tiny generated data, a few runs several tests read.

Most runs are forked from the test server (tests/server.py), which has imported torch and the project once; their
ranks are started by torch's elastic agent as always, forked from the launcher. The scenarios about how a run starts
and ends use new interpreters, as a user's `python train_distribute.py` does; they, and the heaviest runs (the
reference run, runs with decoding workers), start in the background as the session starts (`needs`, `scenario`), at
a lower priority: the tests that run meanwhile go first, and the cores they leave idle are used.
"""

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the suite exercises the CPU/gloo path, also on a machine with GPUs

import train_distribute  # noqa: E402  (after hiding the GPUs)
from resnet import ResNet  # noqa: E402
from safeguards import settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_distribute.py"
SETTINGS = {name: kind for name, kind in train_distribute.__annotations__.items() if name.isupper()}


def width(channels: int) -> list[str]:
    """`--width=N` where the settings block has the ResNet's WIDTH; nothing once another network replaced it."""
    return [f"--width={channels}"] if "WIDTH" in SETTINGS else []


# The recipe and the ways of running that the tests' assertions depend on, as the block ships them: a user's block
# (their schedule, optimizer, precision, TensorBoard on) changes no test's premise. A test of another value gives it.
PINNED = [
    *"--optimizer=muon --lr=0.4 --schedule=onecycle --warmup=0.2 --momentum=0.9 --weight_decay=5e-4".split(),
    *"--label_smoothing=0.2 --augment=True --muon_scale=0.1 --seed=0 --holdout=0 --init_from=".split(),
    *"--num_workers=-1 --eval_every=1 --tta=True --precision=auto --compile=False --accumulate=1".split(),
    *"--tensorboard=False --collective_timeout=600 --epochs=3".split(),
]
# A small, fast run: tiny network, small synthetic images (16x16), several steps per epoch.
TINY = [
    "--dataset=synthetic",
    "--synthetic_size=600",
    "--image_size=16",
    *width(8),
    "--batch_size=48",
    "--world_size=2",
    *PINNED,
]
HANG_TIMEOUT = 240  # seconds; a run that takes longer than this is hanging, not slow


def read_config(argv: list[str]) -> SimpleNamespace:
    return settings.read(train_distribute, argv)


def model_name() -> str:
    """The class name of what make_model returns: the first word of a run's first line."""
    return type(train_distribute.make_model(read_config(TINY), 10)).__name__


# make_model returns the template's ResNet: a test of that network's own premises skips once another is swapped in
TEMPLATE_NETWORK = isinstance(train_distribute.make_model(read_config(TINY), 10), ResNet)
TEMPLATE_ONLY = pytest.mark.skipif(not TEMPLATE_NETWORK, reason="a premise of resnet.py's ResNet; make_model swapped")


def clean_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        and not k.startswith(("TORCHELASTIC_", "SLURM_", "RESNET_DDP_", "TORCH_DISABLE_SHARE_RDZV"))
    }
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def python_path() -> str:
    """The project's folder ahead of the user's own PYTHONPATH (a package of theirs that make_model imports, say)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


# ----------------------------------------------------------------------------- runs forked from the test server


class Server:
    """The test server process, started once per session (it imports torch while the first tests run)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.server"],
            cwd=ROOT,
            env=clean_env(PYTHONPATH=python_path()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self.lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()  # the server ends when its input does
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still importing, on a busy machine
            self.process.kill()
            self.process.wait()


SERVER: list[Server] = []


def pytest_sessionstart(session) -> None:
    """Every temporary file of the session, its runs' too, below pytest's own base folder, which pytest rotates;
    torch's compile cache stays where torch keeps it, so that a compiled run finds the graphs of the last session."""
    tmp = session.config._tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)
    SERVER.append(Server())


def pytest_sessionfinish(session) -> None:
    if SERVER:
        SERVER[0].close()


class Launched:
    """A run the server forked, used as a subprocess.Popen: pid (its own session), poll, wait, communicate, kill."""

    def __init__(self, request: dict) -> None:
        self.stdout_path, self.stderr_path = request["stdout"], request["stderr"]
        self.pid = SERVER[0].ask({"start": request})["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = SERVER[0].ask({"poll": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 10**9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill_session()  # a hanging run must not outlive its test: its launcher waits for it forever
                raise subprocess.TimeoutExpired(f"run {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out = Path(self.stdout_path).read_text(errors="replace")
        return out, "" if self.stderr_path == self.stdout_path else Path(self.stderr_path).read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def kill_session(self) -> None:
        """SIGKILL to the run and every process it started (its ranks, torchrun's workers: one process group)."""
        _kill_session(self.pid)


def launch(
    *args: str,
    env: dict | None = None,
    cwd: Path | None = None,
    call: str | None = None,
    module: str | None = None,
    script: Path | None = None,
    file_size_limit: int = 0,
    merge_output: bool = False,
    output: str | None = None,
    stdout_to: str | None = None,
    ignore_sigint: bool = False,
    cpus: list[int] | None = None,
    ranks_as_interpreters: bool = False,
    nice: int = 0,
) -> Launched:
    """`python train_distribute.py *args` (or call="module:function" with args, or `python -m module *args`, or
    `python script *args`), forked from the test server, in a session of its own, so that a test can signal or
    kill all of it. Its ranks are forked from it, or with ranks_as_interpreters new interpreters, as a user's are.
    `output`: stdout and stderr into this file (a terminal's, say); `stdout_to`: stdout alone (a pipe, say)."""
    folder = tempfile.mkdtemp(prefix="run-")
    stdout = output or stdout_to or os.path.join(folder, "stdout")
    request = {
        "argv": list(args),
        "env": env or clean_env(),
        "cwd": str(cwd or ROOT),
        "stdout": stdout,
        "stderr": stdout if merge_output or output else os.path.join(folder, "stderr"),
        "ignore_sigint": ignore_sigint,
        "cpus": cpus,
        "nice": nice,
        "file_size_limit": file_size_limit,
        "ranks_as_interpreters": ranks_as_interpreters,
    }
    if call:
        request.update(call=call, args=list(args))
    if module:
        request.update(module=module)
    if script:
        request.update(script=str(script))
    return Launched(request)


def start_torchrun(
    *args: str, cwd: Path | None = None, cpus: list[int] | None = None, env: dict | None = None
) -> Launched:
    """`torchrun *args` (args hold the script and its settings), in a session of its own, output merged: torchrun's
    own code forked from the test server, its workers forked from it (--run-path --start-method=fork: the script
    runs in each worker as `python script.py` runs it). test_torchrun_standalone runs the real command."""
    fast = ["--run-path", "--start-method=fork", *args]
    return launch(*fast, module="torch.distributed.run", merge_output=True, cwd=cwd, cpus=cpus, env=env)


def run_script(
    *args: str,
    timeout: float = HANG_TIMEOUT,
    env: dict | None = None,
    cwd: Path | None = None,
    script: Path | None = None,
) -> subprocess.CompletedProcess:
    """The script (train_distribute.py, or a copy) with these arguments, to its end."""
    run = launch(*args, env=env, cwd=cwd, script=script)
    out, err = run.communicate(timeout=timeout)
    return subprocess.CompletedProcess(list(args), run.returncode, out, err)


def call(
    function: str, *args, env: dict | None = None, timeout: float = HANG_TIMEOUT, nice: int = 0
) -> subprocess.CompletedProcess:
    """Call "module:function"(*args) in a process forked from the test server, to its end (`nice`: at that priority)."""
    run = launch(*args, call=function, env=env, nice=nice)
    out, err = run.communicate(timeout=timeout)
    return subprocess.CompletedProcess([function, *args], run.returncode, out, err)


@contextmanager
def new_interpreter(
    command: list[str], timeout: float = HANG_TIMEOUT, nice: int = 0, **options: Any
) -> Iterator[subprocess.Popen]:
    """A real interpreter in a session of its own (`nice`: at that priority). Whatever of it still runs after `timeout`
    seconds, or when the block ends (a failed test), is killed: launcher, ranks and torchrun's workers alike."""
    command = ["nice", "-n", str(nice), *command] if nice else command  # (nice execs it: the same process)
    process = subprocess.Popen(command, cwd=ROOT, text=True, start_new_session=True, **options)
    deadline = threading.Timer(timeout, _kill_session, [process.pid])
    deadline.start()
    try:
        yield process
    finally:
        deadline.cancel()
        _kill_session(process.pid)
        process.wait()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of it has ended
        pass


# ----------------------------------------------------------------------------- runs in new interpreters, early


BACKGROUND = 10  # the scenarios' niceness: the tests that run meanwhile go first, the scenarios take what is left
SCENARIOS: dict[tuple, Future] = {}
_POOL = ThreadPoolExecutor(2, thread_name_prefix="scenario")  # (its threads start with the first scenario)


def needs(*scenarios: tuple) -> Callable:
    """Marks a test that needs these scenarios, (function, *args): each runs real interpreters for seconds of
    imports, so it starts in a background thread as the session starts, while the other tests run."""

    def mark(test: Callable) -> Callable:
        test.scenarios = scenarios
        return test

    return mark


def scenario(function: Callable, *args, timeout: float = 2 * HANG_TIMEOUT) -> Any:
    """What the scenario returned, once it is done (it runs now if the session did not start it)."""
    start(function, *args)
    return SCENARIOS[(function.__qualname__, *args)].result(timeout=timeout)


def start(function: Callable, *args) -> None:
    """Two at a time (2 ranks each), in the order asked for."""
    if (key := (function.__qualname__, *args)) not in SCENARIOS:
        SCENARIOS[key] = _POOL.submit(function, *args)


WAITING = ("test_torchrun.py", "test_waits.py")  # tests that mostly wait (heartbeats, timeouts): the CPU is free


def pytest_collection_modifyitems(items: list) -> None:
    """The tests that mostly wait first, beside the scenarios, which start at once and use the CPU; the tests that
    need a scenario last, so that they find it done (a stable sort: each file's order stays)."""
    items.sort(
        key=lambda item: (
            bool(getattr(getattr(item, "function", None), "scenarios", ())),
            item.path.name not in WAITING,
        )
    )


def pytest_collection_finish(session) -> None:
    """The reference run first (tests compare with it meanwhile), then the long scenarios (function.long: tens of
    seconds), so that the last ones to end are short, then the others in the tests' order."""
    wanted = [(reference,)] if any("reference_run" in getattr(i, "fixturenames", ()) for i in session.items) else []
    for item in session.items:
        if any(mark.args[:1] == (True,) for mark in item.iter_markers("skipif")):  # skipped: not needed
            continue
        wanted += getattr(getattr(item, "function", None), "scenarios", ())
    for function, *args in sorted(wanted, key=lambda s: (s[0] is not reference, not getattr(s[0], "long", False))):
        start(function, *args)


# ----------------------------------------------------------------------------- reading runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def csv_rows(output_dir: Path) -> int:
    path = output_dir / "pytorch_res.csv"
    return len(pd.read_csv(path)) if path.exists() else 0


def snapshot(folder: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every file and folder below `folder`: its modification time and bytes, to show that nothing changed."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
        for p in folder.rglob("*")
    }


def wait_for_rows(output_dir: Path, rows: int, process, timeout: float = HANG_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while csv_rows(output_dir) < rows:
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before writing {rows} rows"
        assert time.monotonic() < deadline, "no CSV rows in time: the run hangs"
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    """Every descendant process of pid (Linux /proc)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent:
                    found.append(int(entry.name))
                    frontier.append(int(entry.name))
    return found


def recorded_ranks(folder: Path, count: int = 2, timeout: float = HANG_TIMEOUT) -> list[int]:
    """The rank processes' ids in rank order, as each rank recorded its own (TEST_PIDS=folder, tests/hooked_run.py)."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("rank*.pid"))) < count:
        assert time.monotonic() < deadline, "the ranks did not start in time"
        time.sleep(0.05)
    time.sleep(0.05)  # each file is written whole by then
    return [int((folder / f"rank{rank}.pid").read_text()) for rank in range(count)]


def alive(pid: int) -> bool:
    """Until every thread has ended: a killed process's first thread is a zombie while the others still exit, holding
    its files (OUTPUT_DIR's lock: a resume started then is refused; 177 of 300 kills of 9 busy threads left it held)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def reference() -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted 2-rank run of 5 epochs that several tests inspect: the first scenario of the session."""
    out = Path(tempfile.mkdtemp(prefix="reference-")) / "out"
    args = [*TINY, "--epochs=5", f"--output_dir={out}"]
    run = launch(*args, nice=BACKGROUND)
    stdout, stderr = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 0, stdout + stderr
    return out, subprocess.CompletedProcess(args, run.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def reference_run() -> tuple[Path, subprocess.CompletedProcess]:
    return scenario(reference)


def image_folder_of_noise(root: Path, train: int, test: int, size: int = 32, seed: int = 0, brighter: int = 90) -> None:
    """Two classes (a, b) of PNGs of random pixels, `brighter` levels brighter in class b, in train/ and test/."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("test", test)):
        for number in range(count):
            label = "ab"[number % 2]
            (root / split / label).mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 160, (size, size, 3)) + brighter * (label == "b")
            Image.fromarray(pixels.astype(np.uint8)).save(root / split / label / f"{number:04d}.png")


_TINY_STREAM: list[list[str]] = []
_MAKING_TINY_STREAM = threading.Lock()  # the session's tests and its scenarios (threads) share one folder


def tiny_stream_args() -> list[str]:
    """TINY's counterpart for image folders (the stream loader): half as many images, 16x16, read from PNG files by
    one worker per rank, and one entry of each kind that the reader skips (their line would name them)."""
    with _MAKING_TINY_STREAM:
        if not _TINY_STREAM:
            root = Path(tempfile.mkdtemp(prefix="stream-")) / "images"
            image_folder_of_noise(root, train=300, test=60, size=16)
            (root / "train" / "a" / "notes.txt").write_text("not an image")
            (root / "train" / "a" / "._0000.png").write_bytes(b"\x00\x05\x16\x07")  # macOS's fork beside an image
            (root / "train" / "b" / "more").mkdir()
            _TINY_STREAM.append([*TINY, "--dataset=imagefolder", f"--data_dir={root}", "--image_size=16"])
        return [*_TINY_STREAM[0], "--num_workers=0"]


@pytest.fixture(scope="session")
def tiny_stream() -> list[str]:
    return tiny_stream_args()
