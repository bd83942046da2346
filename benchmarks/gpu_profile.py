"""Where a training step's time goes on the GPU, for this project and for the seed at its best, side by side: torch's
profiler over a few training steps of each (one rank, DDP in the path), the kernel time per step by group, the wall
clock per step, and the share of it in which no kernel runs (the GPU idle, waiting for launches or data).

    python -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20            # one GPU
    python -m benchmarks.gpu_profile --width=64 --batch_size=512 --steps=20 --compile  # the project compiled
    python -m benchmarks.gpu_profile --width=8 --batch_size=64 --steps=3               # no GPU: the CPU fallback

project:          train_distribute's own build_run and train_step on generated images held on the device (the memory
                  loader's batches: crops, flips and normalisation on the device), as a user runs it (bf16 autocast,
                  channels_last, Muon).
seed at its best: benchmarks/throughput.py's (a'): PIL images through DataLoader workers, pinned memory, non-blocking
                  copies, fp32 (cuDNN's default TF32 convolutions), Adam (foreach), DDP.
Each kernel counts in the group of the operator that launched it: collectives (NCCL's kernels: DDP's all-reduce, an
optimizer's), then within the optimizer's step the Newton-Schulz products (mm, bmm, baddbmm) apart from the rest of
the optimizer, then copies (memcpy and memset, aten::copy_ and what calls it: host-to-device batches, autocast's
casts of the weights, layout changes), convolutions, BatchNorm, and element-wise for everything else (ReLU, adds, the
loss, the crop's gather, the head's small product). Without a GPU the same steps run on the CPU and the table holds
CPU time by the same groups: a check of this script, not a GPU figure. --out FILE also writes the table (markdown).
"""

import argparse
import os
import socket
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

import distribute_tools
import train_distribute as td
from data import make_synthetic
from resnet import ResNet
from safeguards import settings

GROUPS = ("convolutions", "BatchNorm", "element-wise", "Newton-Schulz products", "optimizer", "copies", "collectives")
PRODUCTS = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::matmul")
WARMUP = 5  # untimed steps first: cuDNN's choice of kernels, the compiler, the allocator, the loader's workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_of(op: str, kernel: str, in_optimizer: bool) -> str:
    """The group of a kernel, from the operator that launched it and the kernel's own name."""
    op, kernel = op.lower(), kernel.lower()
    if "nccl" in kernel or "nccl" in op or op.startswith(("c10d::", "gloo:")):
        return "collectives"
    if in_optimizer:
        return "Newton-Schulz products" if op in PRODUCTS else "optimizer"
    if "memcpy" in kernel or "memset" in kernel or op in ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone"):
        return "copies"
    if "conv" in op or "conv" in kernel or any(part in kernel for part in ("fprop", "dgrad", "wgrad")):
        return "convolutions"
    if "batch_norm" in op or "batch_norm" in kernel or "batchnorm" in kernel or "bn_" in kernel:
        return "BatchNorm"
    return "element-wise"


def in_optimizer_step(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step#"):
            return True
        event = event.cpu_parent
    return False


def grouped_seconds(profiler: profile, gpu: bool) -> dict[str, float]:
    """Seconds by group: of the kernels each operator launched (GPU), or of each operator's own CPU time (CPU)."""
    seconds = dict.fromkeys(GROUPS, 0.0)
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CPU or getattr(event, "is_async", False):
            continue
        optimizer = in_optimizer_step(event)
        if gpu:
            for kernel in event.kernels:
                seconds[group_of(event.name, kernel.name, optimizer)] += kernel.duration / 1e6
        elif "::" in event.name:  # operators (aten::, c10d::), not the ranges that hold them (DDP's forward, say)
            seconds[group_of(event.name, "", optimizer)] += event.self_cpu_time_total / 1e6
    return seconds


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


def profiled(steps: Iterator[Callable[[], None]], count: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per step by group, the wall clock and kernel time per step, the idle share: `count` steps after
    WARMUP untimed ones."""
    for _ in range(WARMUP):
        next(steps)()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        for _ in range(count):
            next(steps)()
        synchronize(device)
        wall = time.perf_counter() - started
    row = {group: 1e3 * s / count for group, s in grouped_seconds(profiler, device.type == "cuda").items()}
    row["kernel time" if device.type == "cuda" else "operator time"] = sum(row.values())
    row["wall clock"] = 1e3 * wall / count
    if device.type == "cuda":
        row["idle share %"] = 100 * max(0.0, 1 - busy_seconds(profiler) / wall)
    return row


def project_steps(cfg, info) -> Iterator[Callable[[], None]]:
    """train_distribute's own steps: its run, its batches, its train_step."""
    run = td.build_run(cfg, info)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING)
    sums = torch.zeros(3, device=info.device)
    for epoch in range(1, 10**6):
        for x, y in run.train_data.train_batches(cfg.BATCH_SIZE, 1, 0, cfg.SEED, epoch):
            yield lambda x=x, y=y: td.train_step(run, x, y, 0.1, loss_fn, sums)


def seed_steps(args: argparse.Namespace, info) -> Iterator[Callable[[], None]]:
    """The seed at its best (benchmarks/throughput.py's (a')): each step takes its batch from the loader first."""
    from benchmarks.throughput import PilImages, cores

    images, labels = make_synthetic((args.steps + WARMUP) * args.batch_size, seed=0, split=0)
    gpu = info.device.type == "cuda"
    loader = DataLoader(
        PilImages(images, labels),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=max(1, cores()),
        pin_memory=gpu,
        persistent_workers=True,
    )
    model = DistributedDataParallel(ResNet(args.width).to(info.device), device_ids=[info.device.index] if gpu else None)
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


def table(rows: dict[str, dict[str, float]], unit: str) -> str:
    names = list(rows)
    lines = [f"| {unit} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key in rows[names[0]]:
        lines.append(f"| {key} | " + " | ".join(f"{rows[name].get(key, float('nan')):.2f}" for name in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="profiled steps of each, after 5 untimed ones")
    parser.add_argument("--compile", action="store_true", help="the project compiled (COMPILE=True)")
    parser.add_argument("--skip_seed", action="store_true", help="the project alone")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args()
    cfg = settings.read(
        td,
        [
            "--dataset=synthetic",
            f"--synthetic_size={(args.steps + WARMUP) * args.batch_size}",
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
    rows = {
        f"project{' (compiled)' if args.compile else ''}": profiled(project_steps(cfg, info), args.steps, info.device)
    }
    torch.backends.cudnn.benchmark = False  # the seed's own setting (the project set it for itself)
    if not args.skip_seed:
        rows["seed at its best"] = profiled(seed_steps(args, info), args.steps, info.device)
    gpu = info.device.type == "cuda"
    name = torch.cuda.get_device_name(info.device) if gpu else "no GPU here: CPU time by group, not a GPU figure"
    heading = f"{args.steps} steps of width {args.width}, batch {args.batch_size}, one rank, torch {torch.__version__}"
    text = f"{heading} ({name})\n\n{table(rows, 'ms per step' if gpu else 'CPU ms per step')}\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    distribute_tools.cleanup()


if __name__ == "__main__":
    main()
