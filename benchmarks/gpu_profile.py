"""How busy the GPU is while the project trains: the share of wall-clock time in which no kernel runs, over
about 20 profiled training steps of train_distribute.py's own code (one rank).

    python -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20

A high idle share means the GPU waits for the Python thread that launches its kernels (small batches,
many small kernels): raise the per-GPU batch, or try --compile.
"""

import argparse
import os
import socket
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import distribute_tools
import train_distribute as td
from safeguards import settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    cfg = settings.read(
        td,
        [
            "--dataset=synthetic",
            f"--synthetic_size={(args.steps + 5) * args.batch_size}",
            f"--width={args.width}",
            f"--batch_size={args.batch_size}",
            f"--compile={args.compile}",
            "--world_size=1",
        ],
    )
    # this process is the run's one rank, as torchrun would start it
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    info = distribute_tools.setup()
    run = td.build_run(cfg, info)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING)
    sums = torch.zeros(3, device=info.device)
    batches = run.train_data.train_batches(cfg.BATCH_SIZE, 1, 0, cfg.SEED, epoch=1)
    for _ in range(5):  # warm-up: cudnn's choice of kernels, the compiler, the allocator
        x, y = next(batches)
        td.train_step(run, x, y, 0.1, loss_fn, sums)
    synchronize(info.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        for x, y in batches:
            td.train_step(run, x, y, 0.1, loss_fn, sums)
        synchronize(info.device)
        wall = time.perf_counter() - started
    busy = busy_seconds(profiler)
    print(
        f"{args.steps} steps of width {args.width}, batch {args.batch_size}{', compiled' if args.compile else ''}: "
        f"{wall:.3f} s wall clock, GPU busy {busy:.3f} s, idle share {100 * max(0.0, 1 - busy / wall):.1f}%"
        + ("" if info.device.type == "cuda" else " (no GPU here: the steps ran on the CPU)")
    )
    del run, batches
    distribute_tools.cleanup()


def busy_seconds(profiler: profile) -> float:
    """Seconds in which at least one GPU kernel (or copy) runs: the union of their intervals."""
    intervals = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profiler.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6  # microseconds


if __name__ == "__main__":
    main()
