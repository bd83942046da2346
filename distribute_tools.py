"""Who each process is, and the seed's helpers for DDP. The one place that decides rank, device and backend.

    run_distribute(worker, world_size, *args) -> int   run worker(rank, world_size, *args) on every rank
    with process_group(rank, world_size) as dist_info:  setup(), then cleanup() however the block ends
    setup(rank, world_size) -> DistInfo                 join the group: device, backend and CPU threads
    cleanup(every_rank_leaves)                          leave the group

Started by torchrun (RANK, LOCAL_RANK and WORLD_SIZE in the environment) the worker runs in this
process; otherwise run_distribute starts one process per rank on this machine (processes.py: ports,
signals, exit codes, failures).
"""

import datetime
import functools
import gc
import inspect
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import processes
from processes import UserError

T = TypeVar("T")
# DDP options that keep BatchNorm statistics as each rank computes them: evaluation gives every rank rank 0's
# itself, once per epoch, instead of a broadcast before every training step (torch 2.14 renamed the option).
_RENAMED = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
NO_BUFFER_SYNC = {"forward_sync_buffers" if _RENAMED else "broadcast_buffers": False}


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


def run_distribute(worker: Callable[..., None], world_size: int, *args: Any) -> int:
    """Run worker(rank, world_size, *args) on every rank; the exit code of the whole run (0: every rank
    finished). Under torchrun this process is one rank and runs the worker itself; otherwise it starts
    `world_size` processes and waits for them."""
    if under_torchrun():
        return processes.run_rank(int(os.environ["RANK"]), worker, world_size, args)
    return processes.launch(worker, world_size, args)


def setup(rank: int, world_size: int, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group. Collectives that wait longer than `timeout_s` fail instead of hanging."""
    # torch.distributed.nn's functions take the default group as a default argument: imported after the group
    # exists (DDP's constructor imports it, through torch._dynamo), they hold the group, so that
    # destroy_process_group cannot free it and its gloo threads outlive it. At interpreter exit such a thread
    # freeing a tensor then waits for the GIL and aborts the process ("terminate called without an active
    # exception", seen in 16 of 115 finished runs). Imported first, they hold nothing (measured: the
    # group's threads end at destroy).
    import torch.distributed.nn  # noqa: F401

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device, backend = choose_device(local_rank, local_world_size)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, so NCCL never puts two ranks on GPU 0
        options["device_id"] = device
    torch.set_num_threads(max(1, cpu_cores() // local_world_size))  # the ranks of a machine share its cores
    store, attempt = processes.torchrun_store(rank, world_size, timeout_s)
    if store is not None:
        options["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size, **options)
    all_ranks_meet()  # before a rank acts on a stop signal: none leaves a peer still connecting (gloo logs an error)
    restarted = processes.restart_count() > 0 or attempt > 1
    return DistInfo(rank, local_rank, world_size, local_world_size, device, backend, restarted)


def cleanup(every_rank_leaves: bool) -> None:
    """Leave the process group. `every_rank_leaves`: all ranks got here together (the normal end, or a
    UserError that every rank raised); they wait for each other first, since a rank that tears the group
    down while another still uses it aborts the run. After a failure of some ranks only, the group stays for
    the rank's exit to drop (processes.run_rank): NCCL's destroy waits for collectives that the peers may never
    join, and gloo's deadlocks on one that was cut short (docs/performance.md, torch releases)."""
    if not (every_rank_leaves and dist.is_initialized()):
        return
    gc.collect()  # the DDP model and its reducer hold the group: freed first, the group's threads end with it
    token = all_ranks_meet()
    dist.destroy_process_group()
    del token  # freed after the group: torch 2.4's gloo thread could otherwise free it during destroy


@contextmanager
def process_group(rank: int, world_size: int, timeout_s: float = 600.0) -> Iterator[DistInfo]:
    """setup(), then cleanup() however the block ends. Stop signals are handled from the moment the rank
    belongs to the group. A failure is reported (processes.report) before the group is left: once one rank
    exits, the launcher stops the others, and a later report could be lost. It leaves as SystemExit(code)."""
    info = setup(rank, world_size, timeout_s)
    together = False
    try:
        processes.handle_stop_signals()  # a signal held back while the rank started arrives here, inside the try
        yield info
        together = True
    except BaseException as error:
        together = isinstance(error, UserError)  # raised on every rank alike (see UserError)
        code = processes.report(error, info.rank)
        chained: BaseException | None = error  # its frames and those of the errors it came from: their locals
        while chained is not None:  # (the model) must not outlive a group that cleanup destroys
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__context__
        raise SystemExit(code) from None
    finally:
        cleanup(every_rank_leaves=together)


# ----------------------------------------------------------------------------- who and where


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """NCCL on this rank's own GPU when there are GPUs, gloo on the CPU otherwise. With every GPU of the
    machine visible the rank takes GPU `local_rank`; with one GPU visible per process (SLURM's
    --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank) it takes that one."""
    visible = gpu_count()
    if visible == 0:
        processes.check_gpus_usable()
        return torch.device("cpu"), "gloo"
    if visible >= local_world_size:
        return torch.device("cuda", local_rank), "nccl"
    if visible == 1:
        return torch.device("cuda", 0), "nccl"
    raise UserError(
        f"{local_world_size} processes on this machine but each sees {visible} GPUs: two ranks would share a "
        f"GPU; start one process per GPU (--nproc_per_node={visible}), or give each process exactly one GPU"
    )


def resolve_world_size(requested: int) -> int:
    """The number of ranks: torchrun's when it launched us; else `requested`, 0 meaning every GPU (2
    processes on a machine without one). Refuses counts that cannot work, before anything starts."""
    if under_torchrun():
        choose_device(int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        started = int(os.environ["WORLD_SIZE"])
        if requested not in (0, started) and os.environ["RANK"] == "0":
            print(f"warning: WORLD_SIZE={requested} is ignored under torchrun, which started {started} ranks")
        return started
    if (gpus := gpu_count()) == 0:
        processes.check_gpus_usable()
    if requested < 0:
        raise UserError(f"WORLD_SIZE={requested} is negative; use 0 (every GPU, or 2 CPU processes) or a count")
    if gpus and requested > gpus:
        raise UserError(f"WORLD_SIZE={requested} but this machine has {gpus} GPU(s); use 0 or at most {gpus}")
    return requested or gpus or 2


def route_around_cpu_crashes(model: torch.nn.Module, device: torch.device) -> None:
    """On AVX-512 CPUs oneDNN's channels_last weight gradient of a strided 1x1 convolution with at most 8 input
    channels corrupts the heap (docs/cpu-kinds.md). On CPUs such a convolution takes every stride-th pixel first
    and then runs with stride 1: the same function through another kernel (faster, too, at those widths)."""
    for conv in model.modules() if device.type == "cpu" else ():
        if isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (1, 1) and conv.padding in ((0, 0), "valid"):
            if conv.stride != (1, 1) and conv.in_channels <= 8:
                conv.register_forward_pre_hook(functools.partial(_subsample, stride=conv.stride))
                conv.stride = (1, 1)


def _subsample(conv: torch.nn.Module, inputs: tuple[torch.Tensor], stride: tuple[int, int]) -> tuple[torch.Tensor]:
    return (inputs[0][..., :: stride[0], :: stride[1]],)


def bf16_is_fast(device: torch.device) -> bool:
    """bf16 autocast pays off on GPUs with bf16 and on CPUs with native bf16 instructions."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere and newer; older GPUs emulate bf16
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    except OSError:  # not Linux
        return False


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (GPUs run asynchronously; CPUs have nothing queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_cores() -> int:
    """The cores this process may run on (all of them where the system cannot say, as off Linux)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------- collectives: every rank calls them


def all_ranks_meet() -> torch.Tensor:
    """Wait until every rank gets here, on gloo and NCCL alike: an all-reduce of one number, read back on
    the host (on NCCL the all-reduce alone returns as soon as it is queued)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    token.item()
    return token


def all_ranks_try(action: Callable[[], T] | None) -> T | None:
    """The ranks given an `action` run it (rank 0 alone, say); if it raises a UserError on any of them,
    every rank raises it, so that all stop together. Returns this rank's result."""
    result, error = None, None
    if action is not None:
        try:
            result = action()
        except UserError as e:
            error = str(e)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # every rank's error (or None): the first one stops them all
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)
    return result
