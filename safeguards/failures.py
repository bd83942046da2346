"""How a run ends: stop signals, and the one place (`outcome`) that turns a failure into its line and exit code (0
finished, 2 a mistake, 75 stopped, resumable, 130 Ctrl-C, 1 a failure); `_say` says where the line goes."""

import contextlib
import ctypes
import datetime
import io
import json
import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXIT_MISTAKE, EXIT_STOPPED, EXIT_INTERRUPTED = 2, 75, 130
EXIT_PEER_LOST = 3  # a rank that only lost a peer: the launcher names the rank that failed first (the run exits 1)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_PID = "RESNET_DDP_LAUNCHER_PID"  # set by our launcher for its ranks; absent under torchrun
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, when a peer is gone
HEALTHY_COMPILE = ("Profiler record function", "No CUDA runtime is found")  # what torch logs of a healthy compile
NOTHING_KEPT = "it stopped before any epoch finished; nothing to resume: start the run again"
KEPT = "<the epoch whose files are kept>"  # a line's placeholder, filled in where it is printed: after the files


class UserError(Exception):
    """A problem the user can fix: one line naming it and the fix, exit 2; raised where every rank sees it alike."""


class Stopped(BaseException):
    """A stop signal reached this process: the run ends, its files finished first, and can resume later."""


_received: list[int] = []  # the stop signal this process got, if any
_groups_kept: list[Any] = []  # the process group, where freeing it can hang (kept_alive)
_ending: list[bool] = []  # set first thing when a rank ends: a stop signal arriving then is noted, not raised
_waiting: list[bool] = []  # set while an epoch's files are handed over (all_ranks_try): a stop signal then waits
_kept: list[Callable[[], str]] = []  # says which epoch's files a run that ends now keeps (tell_kept_files)
_claim = threading.Lock()  # held for good by whichever ends the rank, run_rank or end_if_stuck: one line, one code


def tell_kept_files(describe: Callable[[], str]) -> None:
    _kept[:] = [describe]


def kept_files(line: str = KEPT) -> str:
    """`line` with its placeholder filled in: which epoch's files a run that ends now keeps, and how to go on."""
    return line.replace(KEPT, _kept[0]() if _kept else NOTHING_KEPT)


def handle_stop_signals() -> None:
    """From here on the first stop signal raises Stopped (a later one changes nothing: the files are being finished);
    once the rank is ending, or while a lost peer's error unwinds (its signal reached this rank too), it is noted."""

    def on_signal(signum: int, frame: object) -> None:
        if not _received:
            _received.append(signum)
            if not (_ending or _waiting or lost_peer(sys.exc_info()[1])):
                raise Stopped(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def watch_stop_signals(on_stop: Callable[[int], None]) -> None:
    """Python runs handlers in the main thread between bytecodes, never while it waits in torch's C++ code (for the
    store, a missing rank, a collective's stopped peer): a thread woken by each stop signal calls `on_stop` with it."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while True:
            for signum in set(os.read(read, 64)) & set(STOP_SIGNALS):
                on_stop(signum)

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()


def end_if_stuck(signum: int) -> None:
    """A stop the main thread did not take in time (it waits in C++) ends the rank now; one taken lets it finish."""
    time.sleep(3)  # the main thread's time to take it
    if _received or not _claim.acquire(blocking=False):
        return
    _ending.append(_received.append(signum) or True)  # a handler that runs now only notes the signal
    code, line = outcome(Stopped())
    _say(code, line)
    os._exit(code)


def ignore_stop_signals() -> None:
    """The run is complete, or is ending: a signal now must not change how."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def hold_stop_signals_for_ranks() -> None:
    """Ranks started from now on inherit the stop signals held back (a Ctrl-C while they import torch: no traceback).
    This process still gets them through the watching thread, which does not hold them back."""
    watch_stop_signals(stop_ranks)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stop_ranks(signum: int) -> None:
    """The launcher's stop, for the ranks that torch's agent would wait 30 s for: one stopped (SIGSTOP, Ctrl-Z: as a
    hung machine) goes on, to take it; one still starting (importing torch, the signals held back) ends now."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")  # the ranks (Linux)
    for rank in children.read_text().split() if children.exists() else []:
        with contextlib.suppress(OSError, IndexError):  # gone meanwhile
            held = int(Path(f"/proc/{rank}/status").read_text().split("SigBlk:")[1].split()[0], 16) >> (signum - 1) & 1
            os.kill(int(rank), signal.SIGKILL if held else signal.SIGCONT)


def guard_parent(launcher: str | None) -> None:
    """A rank must not outlive its launcher or torchrun (kill -9 of it) holding the GPU and OUTPUT_DIR; nor start."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL) if sys.platform.startswith("linux") else None  # 1 = PR_SET_PDEATHSIG
    if launcher and launcher != str(os.getppid()):
        os._exit(EXIT_STOPPED)


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torch's env:// store, in a part that is this start's alone: torchrun keeps its store across restarts, and an
    earlier attempt's keys would connect the group to ranks that are gone (pytorch#135712). Rank 0 names a new part;
    another rank uses a name once rank 0 answered its question asked there (an earlier attempt's name gets none)."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    if rank == 0:
        part = uuid.uuid4().hex
        store.set("attempt", part)
        for other in range(1, world_size):  # each rank's question, asked in this part (get waits for it)
            store.set(f"{part}/answers/{store.get(f'{part}/asks/{other}').decode()}", "")
        return dist.PrefixStore(part, store)
    question, deadline = uuid.uuid4().hex, time.monotonic() + timeout.total_seconds()
    while True:
        part = store.get("attempt").decode()
        store.set(f"{part}/asks/{rank}", question)
        try:
            store.wait([f"{part}/answers/{question}"], datetime.timedelta(seconds=1))
            return dist.PrefixStore(part, store)
        except RuntimeError:  # no answer in time: an earlier attempt's name, or rank 0 still waits for another rank
            if time.monotonic() > deadline:
                raise


def kept_alive(group: Any) -> Any:
    """`group`, kept where freeing it can hang (torch 2.4 to 2.7 free it holding Python's lock while joining a thread
    that may need the lock to free a collective's tensors: pytorch#154976); run_rank ends the process without it."""
    _groups_kept.extend([group] if torch.__version__ < "2.8" else [])
    return group


def all_ranks_try(action: Callable[[], Any] | None, hold_stops: bool = False) -> Any:
    """DDP: every rank calls it, those given an `action` run it; a UserError on any is raised on all (all stop).
    `hold_stops`: from the meeting on, a stop signal waits for stops_go_on (an epoch's files handed over, counted)."""
    result, error = None, None
    try:
        result = action() if action else None
    except UserError as e:
        error = str(e)
    errors: list[str | None] = [None] * dist.get_world_size()
    _waiting.extend([True] * hold_stops)  # a stop during the action (rank 0 waits for the disk) still ends it at once
    dist.all_gather_object(errors, error)  # every rank's error or None
    if any(errors):
        raise UserError(next(e for e in errors if e))
    return result


def stops_go_on() -> None:
    """A stop signal held since all_ranks_try(hold_stops=True) ends the rank now: every rank names the same epoch."""
    _waiting.clear()
    if _received and not _ending:
        raise Stopped(signal.Signals(_received[0]).name)


# ----------------------------------------------------------------------------- the one place for lines and codes
class _Stdout(io.TextIOWrapper):
    """stdout, each write straight to the file: a closed pipe fails the write, which sends the rest to /dev/null."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.fileno())
            return len(text)


def survive_closed_stdout() -> None:
    """A reader that is gone (`python train_distribute.py | head -2`) must not stop a run: the files are its record."""
    sys.stdout.flush()
    raw = open(sys.stdout.fileno(), "wb", buffering=0, closefd=False)
    sys.stdout = _Stdout(raw, encoding="utf-8", write_through=True)  # UTF-8 whatever the locale (paths, class names)


def quiet_compile(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile(model), without the lines torch logs in every healthy compile on a CPU; nothing else is hidden."""
    with contextlib.redirect_stderr(io.StringIO()):  # torch 2.4 prints its line as this is imported, not as a log
        import torch.utils.cpp_extension  # noqa: F401
    for name in [name for name in logging.root.manager.loggerDict if name.split(".")[0] == "torch"]:
        for handler in logging.getLogger(name).handlers:  # torch's loggers each have their own
            handler.addFilter(lambda record: not record.getMessage().startswith(HEALTHY_COMPILE))
    return torch.compile(model)


def run_rank(body: Callable[[], None]) -> int:
    """One rank from its first line to its exit code. After a failure the process ends at once: tearing down a group
    that peers left can hang (NCCL waits for them; gloo deadlocked on torch 2.4), and the system closes it anyway."""
    guard_parent(os.environ.get(LAUNCHER_PID))
    survive_closed_stdout()
    try:
        watch_stop_signals(end_if_stuck)
        handle_stop_signals()  # a stop held back while this rank started arrives here
        body()
        if _groups_kept and multiprocessing.parent_process() is None:  # a forked rank's end is an os._exit anyway
            os._exit(0)  # the kept group is never freed
        return 0
    except BaseException as error:  # every way out of a rank becomes its line and code
        _claim.acquire()  # for good (where end_if_stuck ends this rank, this thread waits here)
        _ending.append(True)  # before any Python call runs a pending handler: a stop now is noted, not raised
        ignore_stop_signals()
        code, line = outcome(error)
        _say(code, line)
        os._exit(code)


def run_launcher(body: Callable[[], None]) -> int:
    """The launcher: 0 when every rank finished, else the code of how the run ended, with its one line."""
    survive_closed_stdout()
    try:
        handle_stop_signals()
        body()
        return 0
    except BaseException as error:
        code, line = outcome(error)
        print(kept_files(line), file=sys.stderr, flush=True) if line else None  # every rank has ended: files whole
        return code
    finally:
        ignore_stop_signals()  # a late Ctrl-C cannot turn a finished run into an interrupted one


def outcome(error: BaseException) -> tuple[int, str]:
    """The exit code and the line of a process that ends with `error`, in a rank or in the launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, SystemExit):  # --help, say
        return error.code if isinstance(error.code, int) else 0, ""
    if isinstance(error, ChildFailedError):  # the launcher: the rank that failed first, not one that lost its peer
        rank, first = min(error.failures.items(), key=lambda it: (it[1].exitcode == EXIT_PEER_LOST, it[1].timestamp))
        if first.exitcode in (EXIT_MISTAKE, EXIT_STOPPED, EXIT_INTERRUPTED):  # the ranks were told it
            _received.extend([signal.SIGTERM] if first.exitcode == EXIT_STOPPED else [])
            error = KeyboardInterrupt() if first.exitcode == EXIT_INTERRUPTED else UserError(first.message[7:])
        else:
            how = f"was killed by {first.signal_name()}" if first.exitcode < 0 else f"exited with {first.exitcode}"
            how += " (the out-of-memory killer sends SIGKILL: see `dmesg`)" if first.exitcode == -9 else ""
            said = first.message if first.message.startswith("error: ") else f"error: rank {rank} {how}"
            return 1, f"{said.removesuffix(f'; {KEPT}')}; stopped the other ranks; {KEPT}"  # a rank's own, or ours
    stop = _received[0] if _received else error.sigval if isinstance(error, SignalException) else None
    stop = signal.SIGINT if isinstance(error, KeyboardInterrupt) else stop
    if stop is not None:
        word = "interrupted" if stop == signal.SIGINT else f"stopped by {signal.Signals(stop).name}"
        return (EXIT_INTERRUPTED if stop == signal.SIGINT else EXIT_STOPPED), f"{word}: {KEPT}"
    if isinstance(error, UserError):
        return EXIT_MISTAKE, f"error: {error}"
    rank = os.environ.get("RANK", "0")
    if isinstance(error, torch.cuda.OutOfMemoryError) or "CUDA error: out of memory" in str(error):  # or the driver
        said = ". ".join(first_line(error, 400).split(". ")[:4]).rstrip(".")  # torch's words, to who holds the memory
        how = "resume with --accumulate 2 or more, or start anew with a smaller --batch_size"
        return 1, f"error: rank {rank} ran out of GPU memory ({said}); {how}; {KEPT}"
    if lost_peer(error):
        code = EXIT_PEER_LOST if os.environ.get(LAUNCHER_PID) else 1
        return code, f"[rank {rank}] stopped: another rank failed or was stopped (its connection closed); {KEPT}"
    lines = "".join(traceback.format_exception(error)).rstrip().splitlines()
    print("\n".join(f"[rank {rank}] {line}" for line in lines), file=sys.stderr, flush=True)
    return 1, f"error: rank {rank} failed with {type(error).__name__}: {first_line(error)}"


def _say(code: int, line: str) -> None:
    """Under our launcher the line goes to the launcher, which prints the run's; under torchrun each machine's local
    rank 0 prints a stop or a mistake, every rank a failure (torchrun restarts a mistake: it fails again, alike)."""
    said = line if os.environ.get(LAUNCHER_PID) else kept_files(line)  # this rank's writer is closed: files whole
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # the agent's report names it as the root cause (as @record does)
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": said, "timestamp": int(time.time())}, f)
    if os.environ.get(LAUNCHER_PID):  # our launcher prints it, naming the kept files once every rank has ended
        time.sleep(1 if code == EXIT_PEER_LOST else 0)  # the agent reports one failure: the rank that failed first's
        return
    if code == 1 or os.environ.get("LOCAL_RANK") == "0":
        print(said, file=sys.stderr, flush=True)
    elif code == EXIT_MISTAKE:  # local rank 0 finds it too: it says it, and torchrun then stops this rank (SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(60)


def lost_peer(error: BaseException | None) -> bool:
    return error is not None and any(text in str(error) for text in PEER_LOST)


def first_line(error: BaseException, limit: int = 160) -> str:
    """The error's first line, without the path in torch's C++ sources that gloo puts first ([.../pair.cc:545])."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return re.sub(r"^\[[^\]]*/[^\]]*:\d+\] ", "", line)[:limit]
