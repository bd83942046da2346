"""The process model of a run: who each process is, how the processes start, how they stop.

    run_distribute(worker, world_size, *args)   start worker(rank, world_size, *args) on every rank
    setup(rank, world_size, timeout_s) -> Dist   join the process group; the one place that picks
                                                 device, backend and CPU threads
    cleanup(finished)                            leave the group (barrier first on the normal path)
    with process_group(rank, world_size) as d:   setup, then cleanup however the block ends

Started by torchrun (RANK, LOCAL_RANK and WORLD_SIZE in the environment) the worker
runs in this process and nothing is spawned; otherwise `run_distribute` spawns one
process per rank on this machine, with a free port unless MASTER_PORT is set.
"""
import datetime
import inspect
import logging
import os
import signal
import socket
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

EXIT_REPORTED = 3  # a worker that already printed its one-line error
EXIT_PORT_TAKEN = 4  # rank 0 lost the race for the port it was given
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it


class UserError(Exception):
    """A problem the user can fix. Printed as one line (no traceback). Raise it only for a
    condition that every rank sees alike, so that all ranks stop together."""


@dataclass(frozen=True)
class Dist:
    """Everything a process needs to know about its place in the run."""

    rank: int  # global rank, 0 .. world_size-1
    local_rank: int  # rank on this machine; also the GPU index
    world_size: int
    local_world_size: int  # ranks on this machine
    device: torch.device
    backend: str  # "nccl" or "gloo"

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that prints results and writes files."""
        return self.rank == 0


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_and_backend(local_rank: int) -> tuple[torch.device, str]:
    """NCCL on this rank's own GPU when there are GPUs, gloo on the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def resolve_world_size(requested: int) -> int:
    """The number of ranks: torchrun's when it launched us; else `requested`, 0 meaning every GPU
    (2 processes on a machine without one). Refuses counts that cannot work, before anything starts."""
    gpus = gpu_count()
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if gpus and local > gpus:
            raise UserError(
                f"torchrun starts {local} processes per machine but this machine has {gpus} GPU(s); "
                f"use --nproc_per_node={gpus} or fewer"
            )
        return int(os.environ["WORLD_SIZE"])
    if requested < 0:
        raise UserError(f"WORLD_SIZE={requested} is negative; use 0 (every GPU, or 2 CPU processes) or a positive count")
    if requested == 0:
        return gpus or 2
    if gpus and requested > gpus:
        raise UserError(f"WORLD_SIZE={requested} but this machine has {gpus} GPU(s); use WORLD_SIZE=0 or at most {gpus}")
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


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def setup(rank: int, world_size: int, timeout_s: float = 600.0) -> Dist:
    """Join the process group. Collectives that wait longer than `timeout_s` fail instead of hanging."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device, backend = device_and_backend(local_rank)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL never puts two ranks on GPU 0
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            options["device_id"] = device
    # Ranks of one machine share its cores; more threads than cores slows every rank.
    torch.set_num_threads(max(1, cpu_cores() // local_world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size, **options)
    return Dist(rank, local_rank, world_size, local_world_size, device, backend)


def barrier() -> torch.Tensor:
    """Wait until every rank gets here, on gloo and NCCL alike: an all-reduce of one number, read
    back on the host (on NCCL the all-reduce alone returns as soon as it is queued)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    token.item()
    return token


def raise_if_any(error: Optional[str]) -> None:
    """Collective: every rank passes its own error (or None); if any rank has one, all raise it."""
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)


def cleanup(finished: bool) -> None:
    """Leave the process group. On the normal path wait for every rank first: a rank that tears
    the group down while another still uses it (rank 0 writing files, say) aborts the run.
    After a failure, never wait: NCCL's destroy waits for collectives that the peers may never join."""
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
def process_group(rank: int, world_size: int, timeout_s: float = 600.0) -> Iterator[Dist]:
    """setup(), then cleanup() however the block ends. A failure is reported before the group is
    left: once one rank exits, the launcher stops the others, and a later report could be lost."""
    d = setup(rank, world_size, timeout_s)
    finished = False
    try:
        yield d
        finished = True
    except BaseException as error:
        report_failure(error, d.rank, d.local_rank)
        raise
    finally:
        cleanup(finished)


def report_failure(error: BaseException, rank: int, local_rank: int) -> None:
    """A UserError as one line (once per machine: every rank sees the same problem), anything
    unexpected as a traceback; every line of a rank other than 0 starts with its rank."""
    if getattr(error, "reported", False) or isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    if isinstance(error, UserError):
        if local_rank == 0:
            _print_error(f"{'' if rank == 0 else f'[rank {rank}] '}error: {error}")
    else:
        lines = [f"failed with {type(error).__name__}:", *traceback.format_exc().rstrip().splitlines()]
        _print_error("\n".join(f"[rank {rank}] {line}" for line in lines))
    error.reported = True  # type: ignore[attr-defined]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _is_port_taken(error: BaseException) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "Address already in use" in text


def _print_error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """A rank must not outlive its launcher (`kill -9` of the launcher, say): Linux sends it SIGKILL
    when the launcher dies. (torch asks for SIGINT, which a shell's background job ignores.)"""
    if sys.platform.startswith("linux") and not under_torchrun():  # torchrun watches its workers itself
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _worker_entry(rank: int, worker: Callable[..., None], world_size: int, args: tuple) -> None:
    """Runs `worker` in one rank and turns its failure into an exit code the launcher understands."""
    _die_with_parent()
    try:
        worker(rank, world_size, *args)
    except BaseException as error:
        if rank == 0 and not under_torchrun() and _is_port_taken(error):
            sys.exit(EXIT_PORT_TAKEN)  # the launcher retries with another port
        report_failure(error, rank, int(os.environ.get("LOCAL_RANK", rank)))
        sys.exit(_exit_code(error))


def _exit_code(error: BaseException) -> int:
    if isinstance(error, UserError):
        return EXIT_REPORTED
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, SystemExit):
        return 0 if error.code is None else error.code if isinstance(error.code, int) else 1
    return 1


def run_distribute(worker: Callable[..., None], world_size: int, *args: Any) -> int:
    """Run worker(rank, world_size, *args) on every rank and return the exit code for the whole run.

    Under torchrun this process is one rank: run the worker here. Otherwise spawn `world_size`
    processes; if any of them fails, the others are stopped and the run ends non-zero."""
    if under_torchrun():
        try:
            _worker_entry(int(os.environ["RANK"]), worker, int(os.environ["WORLD_SIZE"]), args)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # loopback: hostnames do not always resolve
    port_is_users = "MASTER_PORT" in os.environ
    for _ in range(3):  # a port found free can be taken before rank 0 binds it
        if not port_is_users:
            os.environ["MASTER_PORT"] = str(free_port())
        code = _spawn(worker, world_size, args)
        if code != EXIT_PORT_TAKEN:
            return code
    if port_is_users:
        _print_error(f"error: MASTER_PORT={os.environ['MASTER_PORT']} is in use; unset MASTER_PORT or choose a free port")
    else:
        _print_error("error: could not bind a free port for the process group three times; try again")
    return 1


def _spawn(worker: Callable[..., None], world_size: int, args: tuple) -> int:
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    context = mp.start_processes(
        _worker_entry, args=(worker, world_size, args), nprocs=world_size, join=False, start_method="spawn"
    )
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill`, scancel: stop like Ctrl-C
    try:
        while not context.join():
            pass
        return 0
    except ProcessExitedException as e:
        return _explain_exit(e)
    except KeyboardInterrupt:
        _stop(context.processes)
        _print_error("interrupted: every rank stopped; files in OUTPUT_DIR are from the last completed epoch")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)


def _explain_exit(e: ProcessExitedException) -> int:
    if e.exit_code == EXIT_REPORTED:  # the rank printed its one line already
        return 1
    if e.exit_code in (EXIT_PORT_TAKEN, EXIT_INTERRUPTED):
        return e.exit_code
    if e.signal_name:
        hint = " (the out-of-memory killer sends SIGKILL: see `dmesg`)" if e.signal_name == "SIGKILL" else ""
        _print_error(f"error: rank {e.error_index} was killed by {e.signal_name}{hint}; stopped the other ranks")
    else:
        _print_error(f"error: rank {e.error_index} exited with code {e.exit_code}; stopped the other ranks")
    return 1


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop(processes: list) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after a few seconds."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
