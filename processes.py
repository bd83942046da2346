"""Starting, stopping and reporting the rank processes: the machinery beneath distribute_tools.run_distribute.

A reader adapting the template can skip this file. What it guarantees:
    exit codes     0 every rank finished; 2 a problem the user can fix (one line); 75 stopped by SIGTERM or
                   SIGUSR1 (resumable); 130 Ctrl-C; 1 anything else (the rank's traceback, or how it died)
    signals        held back while a rank starts (no traceback from a rank still importing torch); then
                   every rank stops together, finishing its files first; ignored once a rank has finished
    failures       one rank failing stops the others within seconds; no rank outlives its launcher
    ports          a free port unless MASTER_PORT is set; a MASTER_PORT that cannot work is one line
"""

import contextlib
import ctypes
import datetime
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import connection, resource_tracker
from typing import Any

import torch
import torch.distributed as dist

EXIT_USER_ERROR = 2  # a problem the user can fix, reported in one line (as argparse exits on a bad argument)
EXIT_PREEMPTED = 75  # SIGTERM or SIGUSR1, a scheduler's stop or warning: resumable (sysexits' EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it
EXIT_PORT_TAKEN = 4  # rank 0 lost the free port it was given to another program: the launcher tries another
EXIT_PEER_LOST = 3  # a spawned rank stopped because another failed: the launcher names the other one (run: 1)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
CANCEL_SIGNAL = signal.SIGUSR2  # the launcher's "another rank failed: finish your files and leave quietly"
GRACE_SECONDS = 30  # how long a rank may take to finish its files once asked to stop, before it is killed
# spawn: a fresh interpreter per rank, what CUDA needs. The tests fork ranks from a process that has
# imported torch once (tests/server.py): the same code, without seconds of imports per rank.
START_METHOD = "spawn"
NOTHING_CHANGED = "it stopped before training began; nothing in OUTPUT_DIR changed"  # a stop before resume.start
TORCHRUN_REPORT = "a mistake that this machine's local rank 0 named above, in its line that starts with 'error: '"
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, when a peer is gone


class UserError(Exception):
    """A problem the user can fix, printed as one line without a traceback. Raise it only for a condition
    that every rank sees alike, so that all ranks stop together."""


class Preempted(BaseException):
    """SIGTERM or SIGUSR1 reached this rank: the run is being stopped and can resume later."""


class Cancelled(BaseException):
    """The launcher is ending the run because another rank failed: leave quietly."""


_stop_signal: list[int] = []  # the stop signal this rank received, if any
_launcher_pid: list[int] = []  # the process that spawned this rank (empty under torchrun)
_finished: list[bool] = []  # set once the rank's work is done
_kept_files: list[Callable[[], str]] = []  # what a run that ends now keeps (tell_kept_files)
_raise_again: list[int] = []  # a stop signal whose exception Python dropped, to raise once more (_raise_stop_again)


# ----------------------------------------------------------------------------- the launcher


def launch(worker: Callable[..., None], world_size: int, args: tuple) -> int:
    """Start `world_size` rank processes on this machine, wait for them, and return the run's exit code.
    Stop signals stay ignored afterwards: a late Ctrl-C cannot turn a finished run into an interrupted one."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")  # loopback: hostnames do not always resolve
    check_master_addr(address)
    users_port = check_master_port(address, os.environ.get("MASTER_PORT"))
    try:
        for _ in range(3):  # a port found free can be taken by another program before rank 0 binds it
            codes, stop = run_ranks(worker, world_size, args, address, users_port or free_port())
            if EXIT_PORT_TAKEN not in codes.values():
                return _explain(codes, stop)
        ours = "another program took the free port three times; try again"
        theirs = f"MASTER_PORT={users_port} was taken by another program; unset MASTER_PORT"
        return report(UserError(theirs if users_port else ours), rank=0)
    finally:
        ignore_stop_signals()


def check_master_addr(address: str) -> None:
    """Every rank of a launched run is on this machine: MASTER_ADDR must be one of its addresses. One that does not
    resolve, or is another machine's, would leave the ranks retrying for COLLECTIVE_TIMEOUT seconds."""
    fix = "unset MASTER_ADDR (127.0.0.1), or use torchrun to train across machines"
    try:
        family, *_, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family) as probe:
            probe.bind(where)
    except socket.gaierror as e:
        raise UserError(f"MASTER_ADDR={address} does not resolve ({e.strerror}); {fix}") from None
    except OSError as e:
        raise UserError(f"MASTER_ADDR={address} is not an address of this machine ({e.strerror}); {fix}") from None


def check_master_port(address: str, port: str | None) -> int | None:
    """The user's MASTER_PORT as a number (None: pick a free one); UserError if it cannot work."""
    if port is None or port.strip() == "0":  # 0 asks for any free port, as it does of bind()
        return None
    if not port.strip().isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"MASTER_PORT={port!r} is not a port number (1-65535); unset it to use a free port")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the process group's store binds it
        try:
            probe.bind((address, int(port)))
        except OSError as e:
            raise UserError(
                f"MASTER_PORT={port} on MASTER_ADDR={address} cannot be used ({e.strerror}); unset MASTER_PORT "
                f"to use a free port, or choose another"
            ) from None
    return int(port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_ranks(
    worker: Callable[..., None], world_size: int, args: tuple, address: str, port: int
) -> tuple[dict[int, int], int]:
    """Start the rank processes and wait for all of them: each rank's exit code (in the order they ended) and
    the stop signal passed on to them, if any."""
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))  # the ranks inherit them
    resource_tracker.ensure_running()  # started now: starting it later would unblock SIGINT and SIGTERM
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited: ranks start with them held back
    try:
        context = multiprocessing.get_context(START_METHOD)
        ranks = [
            context.Process(target=_rank_entry, args=(rank, worker, world_size, args, os.getpid()))
            for rank in range(world_size)
        ]
        for rank in ranks:
            rank.start()
        received: list[int] = []
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: received.append(signum))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came meanwhile is delivered now
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    return _supervise(ranks, received)


def _supervise(ranks: list, received: list[int]) -> tuple[dict[int, int], int]:
    """Wait for every rank. A stop signal to the launcher (or passed up by a rank) goes to every rank; the
    first rank to fail makes the launcher cancel the others. Each rank gets GRACE_SECONDS to finish its
    files, then SIGKILL."""
    codes: dict[int, int] = {}  # rank -> exit code, in the order the ranks ended
    forwarded, deadline = 0, float("inf")
    while len(codes) < len(ranks):
        connection.wait([p.sentinel for p in ranks if p.exitcode is None], timeout=0.1)
        codes.update({rank: p.exitcode for rank, p in enumerate(ranks) if rank not in codes and p.exitcode is not None})
        failed = [code for code in codes.values() if code not in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)]
        if received and not forwarded:
            forwarded, deadline = received[0], time.monotonic() + GRACE_SECONDS
            _signal_alive(ranks, forwarded)
        elif failed and deadline == float("inf"):
            deadline = time.monotonic() + GRACE_SECONDS
            _signal_alive(ranks, CANCEL_SIGNAL)
        if time.monotonic() > deadline:
            _signal_alive(ranks, signal.SIGKILL)
    return codes, forwarded


def _signal_alive(ranks: list, signum: int) -> None:
    for process in ranks:
        if process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                os.kill(process.pid, signum)


def _explain(codes: dict[int, int], forwarded: int) -> int:
    """The run's exit code from the first rank that failed; one line unless that rank printed its own."""
    if all(code == 0 for code in codes.values()):
        return 0  # every rank finished; a signal that came afterwards changes nothing
    if forwarded:  # rank 0 said what was kept
        return EXIT_INTERRUPTED if forwarded == signal.SIGINT else EXIT_PREEMPTED
    # ranks that end within one poll are listed in rank order: a rank that only lost its peer is not the cause
    failed = [(rank, code) for rank, code in codes.items() if code != 0]
    rank, code = next(((r, c) for r, c in failed if c != EXIT_PEER_LOST), failed[0])
    if code in (EXIT_USER_ERROR, EXIT_PORT_TAKEN, EXIT_PREEMPTED, EXIT_INTERRUPTED):
        return code
    code = 1 if code == EXIT_PEER_LOST else code
    how = f"exited with code {code}" if code > 0 else f"was killed by {signal.Signals(-code).name}"
    hint = " (the out-of-memory killer sends SIGKILL: see `dmesg`)" if code == -signal.SIGKILL else ""
    kept = f"; {_kept_files[0]()}" if _kept_files else ""
    print_error(f"error: rank {rank} {how}{hint}; stopped the other ranks{kept}")
    return 1


# ----------------------------------------------------------------------------- one rank


def _rank_entry(rank: int, worker: Callable[..., None], world_size: int, args: tuple, launcher_pid: int) -> None:
    _launcher_pid.append(launcher_pid)
    _kept_files.clear()  # a rank forked from the launcher (the tests) learns its own
    die_with_parent(launcher_pid)
    sys.exit(run_rank(rank, worker, world_size, args))


def run_rank(rank: int, worker: Callable[..., None], world_size: int, args: tuple) -> int:
    """Run worker(rank, world_size, *args) in this process and return its exit code; a failure that no
    distribute_tools.process_group reported is reported here."""
    if not _launcher_pid:  # started by torchrun, which must not leave it behind either
        die_with_parent(None)
    try:
        worker(rank, world_size, *args)
        code = 0
    except BaseException as error:  # every way out of a rank becomes an exit code
        code = report(error, rank)
    ignore_stop_signals()  # leaving: a signal now must not turn into "killed by ..."
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():  # a failed rank's group, left as it was (distribute_tools.cleanup): no teardown
        os._exit(code)  # of it can hang now; the system closes its connections
    return code


def report(error: BaseException, rank: int) -> int:
    """The one place that decides what a rank that fails or is stopped prints, and its exit code; called once
    per error. A stop: rank 0's one line naming the files kept. A UserError: one line per machine. A lost peer:
    one line. Anything else: the rank's traceback. Lines of ranks other than 0 start with the rank."""
    if isinstance(error, SystemExit):  # sys.exit(), or an error distribute_tools.process_group reported
        return error.code if isinstance(error.code, int) else 0 if error.code is None else 1
    error, stop, tag = as_user_error(error), _stopped_by(error), "" if rank == 0 else f"[rank {rank}] "
    if stop:
        if rank == 0:
            print_error(f"{'interrupted' if stop == signal.SIGINT else f'stopped by {stop.name}'}: {kept_files()}")
        return EXIT_INTERRUPTED if stop == signal.SIGINT else EXIT_PREEMPTED
    if isinstance(error, Cancelled):  # another rank failed first: the launcher's line speaks for the run
        return 1
    if isinstance(error, UserError):
        if os.environ.get("LOCAL_RANK", str(rank)) == "0":
            print_error(f"{tag}error: {error}")
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            _tell_torchrun(error)
        return EXIT_USER_ERROR
    if _launcher_pid and port_taken(error):  # rank 0 lost its port: the launcher tries another, silently
        return EXIT_PORT_TAKEN
    if any(text in str(error) for text in PEER_LOST):
        print_error(f"[rank {rank}] stopped: another rank failed or was stopped ({first_line(error)})")
        return EXIT_PEER_LOST if _launcher_pid else 1
    lines = [f"failed with {type(error).__name__}:", *traceback.format_exception(error)]
    print_error("\n".join(f"[rank {rank}] {line}" for text in lines for line in text.rstrip().splitlines()))
    return 1


def kept_files() -> str:
    """What a run that ends now keeps, and how to continue (as told by tell_kept_files)."""
    return _kept_files[0]() if _kept_files else NOTHING_CHANGED


def tell_kept_files(describe: Callable[[], str]) -> None:
    """From now on the line that ends a stopped or failed run adds describe(): which epoch's files are kept,
    and how to continue (resume.py says it, in the launcher and in rank 0)."""
    _kept_files[:] = [describe]


def _stopped_by(error: BaseException) -> signal.Signals | None:
    """The stop signal this rank received (whatever the error it caused: a peer that stopped first, say), also
    one still held back: a peer that got it first can leave while this rank is still joining the group."""
    held = sorted(set(STOP_SIGNALS) & signal.sigpending())
    if _stop_signal or held:
        return signal.Signals(_stop_signal[0] if _stop_signal else held[0])
    return signal.SIGINT if isinstance(error, KeyboardInterrupt) else None


def handle_stop_signals() -> None:
    """From here on SIGINT raises KeyboardInterrupt and SIGTERM or SIGUSR1 raise Preempted, once (a second
    signal must not cut short the files being finished), and the stop reaches the whole run: a spawned rank
    passes it to its launcher, which passes it to every rank. Under torchrun SIGUSR1 goes to torchrun as
    SIGTERM, which stops every worker instead of restarting them (torchrun itself dies of SIGUSR1).
    CANCEL_SIGNAL raises Cancelled. Signals held back while the rank started are delivered now."""

    def on_signal(signum: int, frame: Any) -> None:
        if signum == CANCEL_SIGNAL:
            raise Cancelled
        if _raise_again == [signum]:  # its first raise was dropped (_raise_stop_again): it was passed on then
            _raise_again.clear()
            raise KeyboardInterrupt if signum == signal.SIGINT else Preempted(signal.Signals(signum).name)
        if _stop_signal:
            return
        _stop_signal.append(signum)
        if _finished:  # noted (a peer that leaves now is no failure), not raised: there is nothing left to stop
            return
        if _launcher_pid:
            os.kill(_launcher_pid[0], signum)
        elif signum == signal.SIGUSR1 and os.environ.get("TORCHELASTIC_RUN_ID"):
            os.kill(os.getppid(), signal.SIGTERM)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Preempted(signal.Signals(signum).name)

    for sig in (*STOP_SIGNALS, CANCEL_SIGNAL):
        signal.signal(sig, on_signal)
    sys.unraisablehook = _raise_stop_again
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _raise_stop_again(unraisable: Any) -> None:
    """A stop raised while Python ran a weakref callback or a __del__ (a garbage collection, say) is printed as
    "Exception ignored in ..." and dropped, and the rank would go on as if never stopped: it is raised again,
    once that code has returned, by the same signal. Other unraisable errors are printed as Python prints them."""
    stop = unraisable.exc_value
    if isinstance(stop, (KeyboardInterrupt, Preempted)) and _stop_signal:
        _raise_again[:] = again = _stop_signal[:1]
    elif isinstance(stop, Cancelled):
        again = [CANCEL_SIGNAL]
    else:
        return sys.__unraisablehook__(unraisable)
    # from another thread, a moment later: a signal sent from here would be handled, and dropped, in here
    threading.Timer(0.05, os.kill, (os.getpid(), *again)).start()


def finished() -> None:
    """This rank's work is done and its files are written: a stop signal from now on changes nothing."""
    _finished.append(True)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Stop signals held back while the block runs: a process forked in it starts with them blocked until it
    has set up its own handling (image_folder.quiet_worker), and this process gets any that came meanwhile as
    the block ends."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, (*STOP_SIGNALS, CANCEL_SIGNAL))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def ignore_stop_signals() -> None:
    for sig in (*STOP_SIGNALS, CANCEL_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)


def _tell_torchrun(error: UserError) -> None:
    """torchrun's failure report shows each failed worker's TORCHELASTIC_ERROR_FILE: there it points at our line,
    which local rank 0 printed once (the report would repeat it once per worker). A UserError fails the same way
    after a restart: if torchrun has restarts left, local rank 0 asks it to stop."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": TORCHRUN_REPORT, "timestamp": int(time.time())}, f)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count() <= 0:
        return
    # torchrun restarts after a failed worker, never after SIGTERM. Every worker stays until torchrun's SIGTERM
    # ends it (a worker that left first would count as failed), and local rank 0 asks again each second: Python
    # drops a signal that lands while torchrun forks a worker (3 of 15 runs of 4 fork-started workers).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for _ in range(5):
        if os.environ.get("LOCAL_RANK") == "0":
            os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(1)


def die_with_parent(parent_pid: int | None) -> None:
    """A rank must not outlive its launcher or torchrun (`kill -9` of it), holding the GPU and the
    OUTPUT_DIR lock: Linux sends it SIGKILL when the parent dies. A parent already gone: leave now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(EXIT_PREEMPTED)  # nothing of ours ran yet: no file to finish


# ----------------------------------------------------------------------------- small things


def check_gpus_usable() -> None:
    """A machine whose GPUs the driver shows but torch cannot use must not train on the CPU unnoticed.
    CUDA_VISIBLE_DEVICES= (empty) asks for the CPU explicitly."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not shutil.which("nvidia-smi"):
        return
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return
    gpus = [line for line in listing.splitlines() if line.startswith("GPU ")]
    if gpus:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        raise UserError(
            f"nvidia-smi shows {len(gpus)} GPU(s) but torch {torch.__version__} ({build}) cannot use them; "
            f"install a torch build for this driver (pip install torch, see pytorch.org), or train on the CPU "
            f"on purpose with CUDA_VISIBLE_DEVICES= python train_distribute.py"
        )


RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # set by torchrun, and by SLURM on a requeue


def restart_count() -> int:
    """How often torchrun (TORCHELASTIC_RESTART_COUNT) or SLURM (SLURM_RESTART_COUNT, a requeued job) has
    restarted this run; 0 for a first start."""
    return max(int(os.environ.get(name, "0") or 0) for name in RESTART_COUNTS)


def restarted_by() -> str:
    """What says that this start is a restart, e.g. "SLURM_RESTART_COUNT=1"; "" for a first start."""
    return ", ".join(f"{name}={os.environ[name]}" for name in RESTART_COUNTS if (os.environ.get(name) or "0") != "0")


def port_taken(error: BaseException) -> bool:
    return "EADDRINUSE" in str(error) or "Address already in use" in str(error)


def as_user_error(error: BaseException) -> BaseException:
    """DDP's error for a network with parameters that no step uses, as the one line it deserves."""
    if not (isinstance(error, RuntimeError) and "find_unused_parameters=True" in str(error)):
        return error
    unused = str(error).rpartition("did not receive grad for ")[2].split("\n")[0].strip()
    return UserError(
        f"the network has parameters that no training step uses ({unused or 'see TORCH_DISTRIBUTED_DEBUG=DETAIL'}); "
        f"pass find_unused_parameters=True to DistributedDataParallel in build_run, or leave them out"
    )


def first_line(error: BaseException, limit: int = 160) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def print_error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def launcher_started() -> float:
    """The launcher begins: from now on a stop signal ends it with one line too (a KeyboardInterrupt or Preempted
    for report; under torchrun, which reports its workers' ends, as before). Returns process_start_time()."""
    if not all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):  # not a torchrun worker
        handle_stop_signals()
    return process_start_time()


def process_start_time() -> float:
    """When this process started, on the time.time() clock (Linux; elsewhere: now): Python and torch take
    seconds to import before any code of ours runs, and run clocks start at the very beginning."""
    try:
        with open("/proc/self/stat") as f:
            ticks_after_boot = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        seconds_since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks_after_boot / os.sysconf("SC_CLK_TCK")
        return time.time() - seconds_since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def torchrun_store(rank: int, world_size: int, timeout_s: float) -> tuple[dist.Store | None, int]:
    """Under torchrun: the process group's keys in a part of torchrun's store that no earlier attempt of this
    job used, and that attempt's number. torchrun keeps one store for the whole job and the group's key names
    repeat in every attempt: without this, a restarted rank can read the address a dead attempt left and
    fail ("Connection refused") or hang. (None, 0) where torchrun shares no store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None, 0
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # draws a number never drawn before, and confirms each rank that read the live one
        attempt = store.add("attempt/counter", 1)
        store.set("attempt/current", str(attempt))
        for other in range(1, world_size):
            hello = f"attempt/{attempt}/hello/{other}"
            store.wait([hello])
            store.set(f"attempt/{attempt}/confirmed/{other}/{store.get(hello).decode()}", "1")
        return dist.PrefixStore(f"attempt-{attempt}/", store), attempt
    token, deadline = os.urandom(8).hex(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # a number a dead attempt left is never confirmed: read it again
        store.wait(["attempt/current"])
        attempt = int(store.get("attempt/current"))
        store.set(f"attempt/{attempt}/hello/{rank}", token)
        try:
            store.wait([f"attempt/{attempt}/confirmed/{rank}/{token}"], datetime.timedelta(seconds=2))
            return dist.PrefixStore(f"attempt-{attempt}/", store), attempt
        except RuntimeError:  # DistStoreError on a timeout: a stale number
            continue
    raise RuntimeError(f"rank {rank}: rank 0 did not start its attempt within {timeout_s:.0f} s")
