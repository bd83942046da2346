"""Where a training step's time goes on the GPU, for this project and for the seed at its best, side by side: the
wall clock per step without the profiler, then torch's profiler over as many steps again: the kernel time per step,
the share of the wall clock in which no kernel runs, and the 25 slowest kernels by name with their share of the
kernel time. Both run as one rank (the seed with DDP in its path) after 12 untimed steps (cuDNN's choice of kernels,
the compiler, the allocator, the loader's workers, and DDP's logger, which synchronises on iterations 1 to 10).

    python -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20            # one GPU
    python -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20 --compile  # the project compiled
    python -m benchmarks.gpu_profile --width=4 --batch_size=32 --steps=2 --warmup=1    # no GPU: a check on the CPU

project:          train_distribute's own build_run and train_step on generated images held on the device (the memory
                  loader's batches: crops, flips and normalisation on the device), as a user runs it (bf16 autocast,
                  channels_last, Muon).
seed at its best: benchmarks/throughput.py's (a'): PIL images through DataLoader workers, pinned memory, non-blocking
                  copies, fp32 (cuDNN's default TF32 convolutions), Adam (foreach), DDP.
Without a GPU the same steps run on the CPU and the table lists operators by their own CPU time: a check of this
script, not a GPU figure. --out FILE also writes the tables (markdown).
"""

import argparse
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

import distribute_tools
import train_distribute as td
from benchmarks.throughput import PilImages, cores, synchronize
from data import make_synthetic
from resnet import ResNet
from safeguards import settings

SLOWEST = 25  # kernels listed per side


def timed(steps: Iterator[Callable[[], None]], count: int, device: torch.device) -> float:
    """Seconds of `count` steps, from an empty queue to an empty queue."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(count):
        next(steps)()
    synchronize(device)
    return time.perf_counter() - started


def busy_seconds(kernels: list) -> float:
    """Seconds in which at least one GPU kernel (or copy) runs: the union of their intervals."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((k.time_range.start, k.time_range.end) for k in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e6  # microseconds


def profiled(steps: Iterator[Callable[[], None]], args: argparse.Namespace, device: torch.device) -> dict:
    """The wall clock per step without the profiler, then the profiled steps' kernels (on a CPU: operators)."""
    for _ in range(args.warmup):
        next(steps)()
    wall = timed(steps, args.steps, device) / args.steps
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as profiler:
        profiled_wall = timed(steps, args.steps, device) / args.steps
    if gpu:
        kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        times = [(e.name, e.time_range.end - e.time_range.start) for e in kernels]
        idle = 100 * max(0.0, 1 - busy_seconds(kernels) / args.steps / profiled_wall)
    else:  # operators (aten::, c10d::), not the ranges that hold them
        times = [(e.name, e.self_cpu_time_total) for e in profiler.events() if "::" in e.name]
        idle = float("nan")
    by_name = Counter()
    for name, microseconds in times:
        by_name[name] += microseconds / 1e3 / args.steps
    return {"wall": 1e3 * wall, "kernel": sum(by_name.values()), "idle": idle, "slowest": by_name.most_common(SLOWEST)}


def project_steps(cfg, info) -> Iterator[Callable[[], None]]:
    """train_distribute's own steps: its run, its batches, its train_step."""
    run = td.build_run(cfg, info)
    sums = torch.zeros(3, device=info.device)
    for epoch in range(1, 10**6):
        for x, y in run.train_data.train_batches(cfg.BATCH_SIZE, 1, 0, cfg.SEED, epoch):
            yield lambda x=x, y=y: td.train_step(run, x, y, 0.1, sums)


def seed_steps(args: argparse.Namespace, info) -> Iterator[Callable[[], None]]:
    """The seed at its best (benchmarks/throughput.py's (a')): each step takes its batch from the loader first."""
    images, labels = make_synthetic((2 * args.steps + args.warmup) * args.batch_size, seed=0, split=0)
    gpu = info.device.type == "cuda"
    loader = DataLoader(
        PilImages(images, labels),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=max(1, cores()),
        pin_memory=gpu,
        persistent_workers=True,
    )
    model = DistributedDataParallel(
        ResNet(args.width, seed=True).to(info.device), device_ids=[info.device.index] if gpu else None
    )
    loss_fn, optimizer = nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = iter(loader)

    def step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    while True:
        yield step


def tables(rows: dict[str, dict], gpu: bool) -> str:
    """The figures per step side by side, then each side's slowest kernels."""
    names, what = list(rows), "kernel" if gpu else "operator (CPU)"
    lines = ["| per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines.append("| wall clock, ms (no profiler) | " + " | ".join(f"{rows[n]['wall']:.2f}" for n in names) + " |")
    lines.append(f"| {what} time, ms (profiled) | " + " | ".join(f"{rows[n]['kernel']:.2f}" for n in names) + " |")
    lines.append("| idle share of the wall clock, % | " + " | ".join(f"{rows[n]['idle']:.1f}" for n in names) + " |")
    for name in names:
        lines += [
            "",
            f"{SLOWEST} slowest {what}s of {name}:",
            "",
            f"| {what} | ms per step | share |",
            "|---|---:|---:|",
        ]
        total = rows[name]["kernel"] or 1.0
        lines += [f"| `{k[:100]}` | {ms:.3f} | {100 * ms / total:.1f}% |" for k, ms in rows[name]["slowest"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each, then as many profiled")
    parser.add_argument("--warmup", type=int, default=12, help="untimed steps first")
    parser.add_argument("--compile", action="store_true", help="the project compiled (COMPILE=True)")
    parser.add_argument("--skip_seed", action="store_true", help="the project alone")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args()
    size = (2 * args.steps + args.warmup) * args.batch_size
    given = [f"--synthetic_size={size}", f"--width={args.width}", f"--batch_size={args.batch_size}"]
    cfg = settings.read(td, ["--dataset=synthetic", "--world_size=1", f"--compile={args.compile}", *given])
    # this process is the run's one rank, as torchrun would start it (port 0: the store takes a free one)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    info = distribute_tools.setup()
    rows = {f"project{' (compiled)' if args.compile else ''}": profiled(project_steps(cfg, info), args, info.device)}
    torch.backends.cudnn.benchmark = False  # the seed's own setting (the project set it for itself)
    if not args.skip_seed:
        rows["seed at its best"] = profiled(seed_steps(args, info), args, info.device)
    gpu = info.device.type == "cuda"
    name = torch.cuda.get_device_name(info.device) if gpu else "no GPU here: operators' CPU time, not a GPU figure"
    heading = f"{args.steps} steps (after {args.warmup}) of width {args.width}, batch {args.batch_size}, one rank"
    text = f"{heading}, torch {torch.__version__} ({name})\n\n{tables(rows, gpu)}\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    distribute_tools.cleanup()


if __name__ == "__main__":
    main()
