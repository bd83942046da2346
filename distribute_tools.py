"""The process model of a run: who each process is, how the processes start, how they stop.

    run_distribute(worker, world_size, *args)      run worker(rank, world_size, *args) on every rank
    with process_group(rank, world_size) as info:   setup(), then cleanup() however the block ends
    setup(rank, world_size) -> DistInfo             join the group: the one place that picks the device,
                                                    the backend and the CPU threads of a rank
    cleanup(finished)                               leave the group

Started by torchrun (RANK, LOCAL_RANK and WORLD_SIZE in the environment) the worker runs in
this process and nothing is spawned; otherwise `run_distribute` spawns one process per rank
on this machine, with a free port unless MASTER_PORT is set.

The essentials come first. Below the "supervision" line is what keeps a run from hanging or
leaving processes behind (port retries, signals, exit codes, parent death): a reader adapting
the template can skip it.
"""

import datetime
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXIT_USER_ERROR = 2  # a problem the user can fix, reported in one line (as argparse exits on a bad argument)
EXIT_STOPPED = 75  # stopped by SIGTERM or SIGUSR1 (a scheduler's preemption): resumable (sysexits' EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it


class UserError(Exception):
    """A problem the user can fix. Printed as one line (no traceback). Raise it only for a
    condition that every rank sees alike, so that all ranks stop together."""


class Stopped(BaseException):
    """SIGTERM or SIGUSR1 reached this rank: the run is being stopped (preempted) and can resume."""


@dataclass(frozen=True)
class DistInfo:
    """Everything a process needs to know about its place in the run."""

    rank: int  # global rank, 0 .. world_size-1
    local_rank: int  # rank on this machine
    world_size: int
    local_world_size: int  # ranks on this machine
    device: torch.device
    backend: str  # "nccl" or "gloo"
    restarted: bool = False  # torchrun or SLURM started this run again after a failure or a requeue

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints results and writes files."""
        return self.rank == 0


def setup(rank: int, world_size: int, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group. Collectives that wait longer than `timeout_s` fail instead of hanging."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device, backend = choose_device(local_rank, local_world_size)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL never puts two ranks on GPU 0
        options["device_id"] = device
    # Ranks of one machine share its cores; more threads than cores slows every rank.
    torch.set_num_threads(max(1, cpu_cores() // local_world_size))
    store, attempt = fresh_store(rank, world_size, timeout_s)
    if store is not None:
        options["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size, **options)
    restarted = restart_count() > 0 or attempt > 1
    return DistInfo(rank, local_rank, world_size, local_world_size, device, backend, restarted)


def cleanup(finished: bool) -> None:
    """Leave the process group. When every rank leaves together (the normal end, or a UserError that all
    ranks raised), wait for each other first: a rank that tears the group down while another still uses
    it (rank 0 finishing its files, say) aborts the run. After a failure of some ranks only, never wait:
    NCCL's destroy waits for collectives that the peers may never join."""
    if not dist.is_initialized():
        return
    if finished:
        # Hold the barrier's tensor until the group is gone: in torch 2.4 gloo's worker thread can
        # otherwise free it during destroy and wait for the GIL that destroy holds (a deadlock).
        token = barrier()
        dist.destroy_process_group()
        del token
        return
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()


@contextmanager
def process_group(rank: int, world_size: int, timeout_s: float = 600.0) -> Iterator[DistInfo]:
    """setup(), then cleanup() however the block ends. A failure is reported before the group is
    left: once one rank exits, the launcher stops the others, and a later report could be lost."""
    info = setup(rank, world_size, timeout_s)
    together = False  # every rank leaves at this point: wait for each other before tearing the group down
    try:
        yield info
        together = True
    except BaseException as error:
        report_failure(error, info.rank, info.local_rank)
        together = isinstance(error, UserError)  # raised on every rank alike (see UserError)
        raise
    finally:
        cleanup(finished=together)


def refuse_to_start(error: UserError) -> int:
    """A problem found before any rank started: one line (once per machine under torchrun, which is then
    asked to stop rather than restart a run that would fail the same way); returns the exit code."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print_error(f"error: {error}")
    if under_torchrun():
        _tell_torchrun(error)
    return EXIT_USER_ERROR


def run_distribute(worker: Callable[..., None], world_size: int, *args: Any) -> int:
    """Run worker(rank, world_size, *args) on every rank and return the exit code for the whole run.

    Under torchrun this process is one rank: run the worker here. Otherwise spawn `world_size`
    processes; if any of them fails, the others are stopped and the run ends non-zero."""
    if under_torchrun():
        code = _worker_entry(int(os.environ["RANK"]), worker, world_size, args, None)
        # Leave without the interpreter's teardown: destroying the client of torchrun's store there
        # can abort a rank that has finished ("terminate called without an active exception"), and
        # torchrun would report a failed run whose files are all written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return _spawn_with_free_port(worker, world_size, args)


# ----------------------------------------------------------------------------- who and where


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def restart_count() -> int:
    """How often torchrun (TORCHELASTIC_RESTART_COUNT) or SLURM (SLURM_RESTART_COUNT, a requeued job)
    has restarted this run; 0 for a first start."""
    return max(int(os.environ.get(name, "0") or 0) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def run_ids() -> dict[str, str]:
    """Every name this run has that survives a restart (torchrun's run id, SLURM's job id): a checkpoint
    carries them, so that a restart continues its own run's checkpoint and no other."""
    names = {"torchrun": "TORCHELASTIC_RUN_ID", "slurm": "SLURM_JOB_ID"}
    return {kind: os.environ[name] for kind, name in names.items() if os.environ.get(name)}


def run_id() -> str:
    """The one name the OUTPUT_DIR lock records: torchrun's run id, else SLURM's job id, else nothing."""
    ids = run_ids()
    return ids.get("torchrun") or ids.get("slurm") or ""


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """NCCL on this rank's own GPU when there are GPUs, gloo on the CPU otherwise. With every GPU of the
    machine visible the rank takes GPU `local_rank`; with one GPU visible per process (SLURM's
    --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank) it takes that one."""
    visible = gpu_count()
    if visible == 0:
        check_gpus_usable()
        return torch.device("cpu"), "gloo"
    if visible >= local_world_size:
        return torch.device("cuda", local_rank), "nccl"
    if visible == 1:
        return torch.device("cuda", 0), "nccl"
    raise UserError(
        f"{local_world_size} processes on this machine but each sees {visible} GPUs: two ranks would "
        f"share a GPU; start one process per GPU (--nproc_per_node={visible}), or give each "
        f"process exactly one GPU"
    )


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
            f"nvidia-smi shows {len(gpus)} GPU(s) but torch {torch.__version__} ({build}) cannot use "
            f"them; install a torch build for this driver (pip install torch, see pytorch.org), or "
            f"train on the CPU on purpose with CUDA_VISIBLE_DEVICES= python train_distribute.py"
        )


def resolve_world_size(requested: int) -> int:
    """The number of ranks: torchrun's when it launched us; else `requested`, 0 meaning every GPU
    (2 processes on a machine without one). Refuses counts that cannot work, before anything starts."""
    if under_torchrun():
        choose_device(int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return int(os.environ["WORLD_SIZE"])
    gpus = gpu_count()
    if gpus == 0:
        check_gpus_usable()
    if requested < 0:
        raise UserError(
            f"WORLD_SIZE={requested} is negative; use 0 (every GPU, or 2 CPU processes) or a positive count"
        )
    if requested == 0:
        return gpus or 2
    if gpus and requested > gpus:
        raise UserError(
            f"WORLD_SIZE={requested} but this machine has {gpus} GPU(s); use WORLD_SIZE=0 or at most {gpus}"
        )
    return requested


def bf16_is_fast(device: torch.device) -> bool:
    """bf16 autocast pays off on GPUs with bf16 and on CPUs with native bf16 instructions."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere and newer; older GPUs only emulate bf16
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def process_start_time() -> float:
    """When this process started, on the time.time() clock (Linux; elsewhere: now). Python and torch
    take seconds to import before any code of ours runs: run clocks start here."""
    try:
        with open("/proc/self/stat") as f:
            ticks_after_boot = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        seconds_since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks_after_boot / os.sysconf("SC_CLK_TCK")
        return time.time() - seconds_since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- small collectives


def barrier() -> torch.Tensor:
    """Wait until every rank gets here, on gloo and NCCL alike: an all-reduce of one number, read
    back on the host (on NCCL the all-reduce alone returns as soon as it is queued)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    token.item()
    return token


def raise_if_any(error: str | None) -> None:
    """Collective: every rank passes its own error (or None); if any rank has one, all raise it."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)


def sync_batchnorm(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """BatchNorm statistics over the global batch: torch's SyncBatchNorm on GPUs; on CPUs, where torch
    has none, `CpuSyncBatchNorm`, which all-reduces each layer's per-channel sums."""
    if device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, torch.nn.BatchNorm2d):
            synced = CpuSyncBatchNorm(child.num_features, child.eps, child.momentum)
            synced.load_state_dict(child.state_dict())
            setattr(model, name, synced)
        else:
            sync_batchnorm(child, device)
    return model


class CpuSyncBatchNorm(torch.nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover every rank's images: one all-reduce of the sums and
    sums of squares per layer, differentiable (its backward all-reduces the gradients of the sums)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() == 1:
            return super().forward(x)
        x = x.float()
        channels, count = x.shape[1], x.numel() // x.shape[1]
        local = torch.cat([x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3)), x.new_tensor([count])])
        total = _AllReduceSum.apply(local)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # running statistics keep the unbiased one
            self.num_batches_tracked += 1
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale[None, :, None, None] + (self.bias - mean * scale)[None, :, None, None]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; the gradient of each rank's input is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


@contextmanager
def file_lock(path: str, wait: bool = True) -> Iterator[IO[str]]:
    """An OS lock on `path` (flock): the kernel releases it when the holder exits, however it exits.
    With wait=False, BlockingIOError says another process holds it."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- supervision
# Everything below keeps a run from hanging, losing files or leaving processes behind. A reader
# adapting the template to another model or data set can stop reading here.


def fresh_store(rank: int, world_size: int, timeout_s: float) -> tuple[dist.Store | None, int]:
    """Under torchrun: the process group's keys in a part of torchrun's store that no earlier attempt of
    this job used, and that attempt's number (1 for the first). torchrun keeps one store for the whole
    job and the group's key names are the same in every attempt: without this, the ranks of a restarted
    attempt can read the addresses a dead attempt left there and fail ("Connection refused") or hang.
    (torchrun's restart count cannot name the part: on several machines the agents count differently.)
    (None, 0) where torchrun shares no store (no torchrun, or torch before 2.4): env:// is then fresh."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None, 0
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = _agree_on_attempt(store, rank, world_size, timeout_s)
    return dist.PrefixStore(f"attempt-{attempt}/", store), attempt


def _agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """Rank 0 draws a number never drawn before (an atomic counter) and publishes it; every other rank
    must prove it read the live one, not one a dead attempt left: it sends a random token under the
    number it read, and only the live rank 0 confirms tokens under the live number. No confirmation
    within 2 s: the number was stale, read it again (for at most `timeout_s`, like any collective)."""
    if rank == 0:
        attempt = store.add("attempt/counter", 1)
        store.set("attempt/current", str(attempt))
        for other in range(1, world_size):
            hello = f"attempt/{attempt}/hello/{other}"
            store.wait([hello])
            store.set(f"attempt/{attempt}/confirmed/{other}/{store.get(hello).decode()}", "1")
        return attempt
    token, deadline = os.urandom(8).hex(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        store.wait(["attempt/current"])
        attempt = int(store.get("attempt/current"))
        store.set(f"attempt/{attempt}/hello/{rank}", token)
        try:
            store.wait([f"attempt/{attempt}/confirmed/{rank}/{token}"], datetime.timedelta(seconds=2))
            return attempt
        except RuntimeError:  # DistStoreError on a timeout: a stale number
            continue
    raise RuntimeError(f"rank {rank}: rank 0 did not start its attempt within {timeout_s:.0f} s")


def report_failure(error: BaseException, rank: int, local_rank: int) -> None:
    """A UserError as one line (once per machine: every rank sees the same problem), a lost peer as
    one line, anything unexpected as a traceback; every line of a rank other than 0 starts with its rank."""
    if getattr(error, "reported", False) or isinstance(error, (KeyboardInterrupt, SystemExit, Stopped)):
        return
    if STOPPING:  # a stop is under way: a peer that left first is no news
        return
    tag = "" if rank == 0 else f"[rank {rank}] "
    if isinstance(error, UserError):
        if local_rank == 0:
            print_error(f"{tag}error: {error}")
    elif any(text in str(error) for text in PEER_LOST):
        print_error(f"[rank {rank}] stopped: another rank failed or was stopped ({_first_line(error)})")
    else:
        lines = [f"failed with {type(error).__name__}:", *traceback.format_exc().rstrip().splitlines()]
        print_error("\n".join(f"[rank {rank}] {line}" for line in lines))
    error.reported = True  # type: ignore[attr-defined]


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


def print_error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


EXIT_REPORTED = 3  # a worker that already printed its one-line error
EXIT_PORT_TAKEN = 4  # rank 0 lost the race for the port it was given
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before they stop a job
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, when a peer is gone
GRACE_SECONDS = 30  # how long a stopping rank may take to finish its files before it is killed
STOPPING: list[int] = []  # the stop signal this process received, if any
STOPPED = "every rank stopped; the files in OUTPUT_DIR are from the last completed epoch: continue with --resume True"
STOPPED_UNDER_TORCHRUN = (
    "the files in OUTPUT_DIR are from the last completed epoch; a torchrun restart or requeue continues "
    "from them by itself, a new torchrun command with --resume True"
)


def _worker_entry(
    rank: int, worker: Callable[..., None], world_size: int, args: tuple, launcher_pid: int | None
) -> int:
    """Runs `worker` in one rank and turns its end into an exit code the launcher understands."""
    _die_with_launcher(launcher_pid)
    _stop_on_signals()
    failure: BaseException | None = None
    try:
        worker(rank, world_size, *args)
    except BaseException as error:
        failure = error
        if not (rank == 0 and launcher_pid is not None and _is_port_taken(error)):
            report_failure(error, rank, int(os.environ.get("LOCAL_RANK", rank)))
    STOPPING.append(0)  # leaving: a signal now (torchrun passing ours back, say) must not interrupt the exit
    if failure is None:
        return 0
    if launcher_pid is None:
        if isinstance(failure, Stopped) and rank == 0:  # no launcher of ours to say it: rank 0 does
            print_error(f"stopped by {failure}: {STOPPED_UNDER_TORCHRUN}")
        _tell_torchrun(failure)
        return _exit_code(failure)
    sys.exit(EXIT_PORT_TAKEN if rank == 0 and _is_port_taken(failure) else _exit_code(failure))


def _tell_torchrun(error: BaseException) -> None:
    """A UserError is one a restart cannot mend: local rank 0 asks torchrun to stop rather than restart
    (torchrun restarts after any non-zero exit, but not when it gets SIGTERM itself; see also
    _stop_on_signals). Its failure report shows our one line (the message of the file in
    TORCHELASTIC_ERROR_FILE), not a link."""
    if not isinstance(error, (UserError, Stopped)) or not _torchrun_is_parent():
        return
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json

        message = f"error: {error}" if isinstance(error, UserError) else f"stopped by {error}: {STOPPED}"
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    if isinstance(error, UserError) and os.environ.get("LOCAL_RANK") == "0":
        _stop_torchrun()


def _torchrun_is_parent() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _stop_torchrun() -> None:
    """SIGTERM to torchrun: it stops every worker and exits, where a worker's non-zero exit restarts them."""
    os.kill(os.getppid(), signal.SIGTERM)


def _exit_code(error: BaseException) -> int:
    if isinstance(error, UserError):
        return EXIT_REPORTED
    if isinstance(error, Stopped):
        return EXIT_STOPPED
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, SystemExit):
        return 0 if error.code is None else error.code if isinstance(error.code, int) else 1
    return 1


def _stop_on_signals() -> None:
    """Ctrl-C raises KeyboardInterrupt, SIGTERM and SIGUSR1 raise Stopped, in the main thread, once:
    a second signal while the rank finishes its files must not cut them short. Under torchrun, SIGUSR1
    (a scheduler's warning before it stops the job; torchrun never sends it) is passed to torchrun as
    SIGTERM at once, so that it stops every worker instead of restarting them when this one leaves.
    Not SIGTERM: torchrun sends that itself to the surviving workers before a restart."""

    def handler(signum: int, frame: Any) -> None:
        if STOPPING:
            return
        STOPPING.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGUSR1 and _torchrun_is_parent():
            _stop_torchrun()
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(sig, handler)


def _die_with_launcher(launcher_pid: int | None) -> None:
    """A rank must not outlive its launcher or torchrun (`kill -9` of it, say), holding the GPU, the
    OUTPUT_DIR lock and writing files: Linux sends it SIGKILL when the parent dies. (torch asks for
    SIGINT, which a shell's background job ignores.) If the launcher died before this was set, the rank
    leaves at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if launcher_pid is not None and os.getppid() != launcher_pid:
        os._exit(EXIT_STOPPED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _is_port_taken(error: BaseException) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "Address already in use" in text


def _spawn_with_free_port(worker: Callable[..., None], world_size: int, args: tuple) -> int:
    """Spawn the ranks; pick a free port unless MASTER_PORT is set, and retry if rank 0 loses it."""
    env = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}  # loopback: hostnames do not always resolve
    users_port = os.environ.get("MASTER_PORT")
    for _ in range(3):  # a port found free can be taken before rank 0 binds it
        env["MASTER_PORT"] = users_port or str(free_port())
        code = _spawn(worker, world_size, args, env)
        if code != EXIT_PORT_TAKEN:
            return code
    if users_port:
        print_error(f"error: MASTER_PORT={users_port} is in use; unset MASTER_PORT or choose a free port")
    else:
        print_error("error: could not bind a free port for the process group three times; try again")
    return 1


def _spawn(worker: Callable[..., None], world_size: int, args: tuple, env: dict[str, str]) -> int:
    import logging

    from torch.multiprocessing.spawn import ProcessExitedException

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the children inherit it; this process's own environment is restored below
    signals: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: signals.append(signum)) for sig in (signal.SIGINT, *STOP_SIGNALS)
    }
    try:
        context = mp.start_processes(
            _worker_entry,
            args=(worker, world_size, args, os.getpid()),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        while True:
            try:
                if context.join(timeout=0.2):
                    return 0
            except ProcessExitedException as e:
                code = _explain_exit(e)
                _stop(context.processes)
                return code
            if signals:
                return _stop_on_signal(context.processes, signals[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stop_on_signal(processes: list, signum: int) -> int:
    """Pass the signal on (the ranks finish their files and leave), then wait for them."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signum)
    _stop(processes)
    if signum == signal.SIGINT:
        print_error("interrupted: every rank stopped; the files in OUTPUT_DIR are from the last completed epoch")
        return EXIT_INTERRUPTED
    print_error(f"stopped by {signal.Signals(signum).name}: {STOPPED}")
    return EXIT_STOPPED


def _explain_exit(e: Any) -> int:
    if e.exit_code == EXIT_REPORTED:  # the rank printed its one line already
        return EXIT_USER_ERROR
    if e.exit_code == EXIT_STOPPED:
        print_error(f"stopped by a signal to rank {e.error_index} (SIGTERM or SIGUSR1): {STOPPED}")
    if e.exit_code in (EXIT_PORT_TAKEN, EXIT_INTERRUPTED, EXIT_STOPPED):
        return e.exit_code
    if e.signal_name:
        hint = " (the out-of-memory killer sends SIGKILL: see `dmesg`)" if e.signal_name == "SIGKILL" else ""
        print_error(f"error: rank {e.error_index} was killed by {e.signal_name}{hint}; stopped the other ranks")
    else:
        print_error(f"error: rank {e.error_index} exited with code {e.exit_code}; stopped the other ranks")
    return 1


def _stop(processes: list) -> None:
    """Wait up to GRACE_SECONDS for the ranks to finish their files, asking with SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + GRACE_SECONDS
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
