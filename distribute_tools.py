"""Who each process is, and the seed's helpers for DDP: the one place that decides rank, device and backend.
`run_distribute` starts the ranks here as torchrun does; in a rank, `setup` joins the group and `cleanup` leaves it."""

import contextlib
import datetime
import gc
import getpass
import inspect
import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel

from safeguards import failures
from safeguards.failures import UserError

# DDP options: BatchNorm statistics stay each rank's (evaluation broadcasts rank 0's once an epoch); renamed in 2.14
_RENAMED = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
NO_BUFFER_SYNC = {"forward_sync_buffers" if _RENAMED else "broadcast_buffers": False}
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun gives its ranks


@dataclass(frozen=True)
class DistInfo:
    """Everything a process needs to know about its place in the run."""

    rank: int  # global rank, 0 .. world_size-1
    local_rank: int  # rank on this machine
    world_size: int
    local_world_size: int  # ranks on this machine
    device: torch.device
    backend: str  # "nccl" or "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # global rank 0: the only process that prints results and writes files


def under_torchrun() -> bool:
    """This process is a rank: torch's elastic agent started it (torchrun, or run_distribute), and said so."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def world_size(requested: int) -> int:
    """torchrun's number of ranks; else `requested` (WORLD_SIZE), 0 meaning one per GPU (2 on a machine without).
    RANK and the rest without torchrun are a shell's, another job's: refused, before the launcher waits as a rank."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if set(RANK_VARIABLES[:3]) & set(os.environ):
        found = " ".join(name for name in RANK_VARIABLES if name in os.environ)
        raise UserError(f"{found} set, but not by torchrun: unset {found}, or start ranks with torchrun")
    return requested or (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 2


def run_distribute(entrypoint: Callable[..., Any] | str, world_size: int, *args: Any) -> None:
    """`entrypoint` (a program such as sys.executable, or a function) with `args` in `world_size` ranks here, through
    torchrun's engine: ChildFailedError when a rank fails (the others stopped), SignalException when we are stopped."""
    own_tmpdir = os.environ.get("TMPDIR")  # this process's own, given back as the run ends (a notebook goes on)
    logs = tempfile.TemporaryDirectory(prefix="torchelastic_")  # the agent's folder, removed as the run ends, and the
    os.environ["TMPDIR"] = logs.name  # ranks' TMPDIR: their temporary files (multiprocessing's, torch's) go with it
    default = os.path.join(os.path.dirname(logs.name), f"torchinductor_{getpass.getuser()}")  # torch's own place
    made = not os.path.exists(inductor := os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default))  # COMPILE's cache
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, logs_specs=DefaultLogsSpecs(logs.name))
    config.run_id, config.max_restarts = uuid.uuid4().hex, 0
    config.rdzv_backend, config.rdzv_endpoint = "c10d", "localhost:0"  # a standalone rendezvous on a free port
    config.local_addr = "127.0.0.1"  # else the agent hands the ranks this machine's hostname, which may not resolve
    config.monitor_interval = 0.1  # seconds between the agent's looks at the ranks: a failure stops the others at once
    config.start_method = "fork"  # a function entrypoint only: forked from this process, which imported torch already
    os.environ[failures.LAUNCHER_PID] = str(os.getpid())  # ranks report to us, and leave if we are gone
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # the agent's log: our lines say what happened
        logging.getLogger(name).addHandler(logging.NullHandler())
        logging.getLogger(name).propagate = False
    failures.hold_stop_signals_for_ranks()
    try:
        with logs:
            elastic_launch(config, entrypoint)(*args)
    finally:
        with contextlib.suppress(OSError):  # made by torch._dynamo's import in the ranks, and empty: removed
            os.rmdir(inductor) if made else None
        os.environ.pop("TMPDIR") if own_tmpdir is None else os.environ.update(TMPDIR=own_tmpdir)


def choose_device(local_rank: int, local_world_size: int, gpus: int) -> tuple[torch.device, str]:
    """NCCL on this rank's own GPU (GPU `local_rank`) when there are GPUs, gloo on the CPU otherwise. More ranks here
    than GPUs would put two on one: refused (ranks of one torchrun see the same GPUs), before any training."""
    if gpus == 0:
        return torch.device("cpu"), "gloo"
    if gpus < local_world_size:
        fix = f"start one per GPU (--world_size {gpus}; torchrun: --nproc_per_node={gpus})"
        raise UserError(f"{local_world_size} ranks of this machine would share {gpus} GPU(s); {fix}")
    return torch.device("cuda", local_rank), "nccl"


def refuse_shared_gpu(store: dist.Store, world_size: int, gpu: str) -> None:
    """Ranks of several torchruns (each on GPU 0, say) count their GPU's UUID ("": unknown, torch 2.4): no sharing."""
    store.add(f"gpu {gpu}", 1)
    if store.add("gpus counted", 1) == world_size:  # the last to count tells all
        store.set("every gpu counted", "")
    store.wait(["every gpu counted"])  # DDP: every rank (on GPUs)
    if gpu and (ranks := store.add(f"gpu {gpu}", 0)) > 1:
        raise UserError(f"{ranks} ranks would share GPU {gpu}; give each its own (one torchrun per machine, say)")


def setup(timeout_s: float = 600.0) -> DistInfo:
    """Join the process group. A collective that waits longer than `timeout_s` fails instead of hanging."""
    # torch.distributed.nn, first imported after the group exists (by DDP), holds it, and its gloo threads outlive
    # destroy_process_group: one aborted the process at exit (16 of 115 runs). Imported first, it holds nothing.
    import torch.distributed.nn  # noqa: F401

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend = choose_device(local_rank, local_world_size, gpus)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size))  # the machine's cores, shared
    store = failures.attempt_store(rank, world_size, options["timeout"])  # DDP: every rank; a restart's own keys
    if device.type == "cuda":  # DDP: every rank counts its GPU (refuse_shared_gpu), then waits for all
        torch.cuda.set_device(device)  # before init, so that NCCL never puts two ranks on GPU 0
        options["device_id"] = device
        refuse_shared_gpu(store, world_size, str(getattr(torch.cuda.get_device_properties(device), "uuid", "")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **options)  # DDP: every rank joins
    return DistInfo(rank, local_rank, world_size, local_world_size, device, backend)


def cleanup() -> None:
    """Leave the process group, every rank together: one that tears the group down while another still uses it (rank 0
    finishing its files, say) can abort the run. (After a failure a rank ends without it: safeguards.failures.)"""
    gc.collect()  # the DDP model and its reducer hold the group: freed first, the group's threads end with it
    dist.barrier()  # DDP: every rank meets
    dist.destroy_process_group(failures.kept_alive(dist.group.WORLD))  # (torch < 2.8: kept to the end, see there)
