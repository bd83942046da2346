"""Launches per training step, counted on any machine: the ATen operations (views left out) of a whole training
epoch divided by its steps, by phase, for this project as a user runs it and for the seed's step, in one process.

    python -m benchmarks.launches                 # width 64, global batch 64, 4 steps an epoch
    python -m benchmarks.launches --width 8 --ops  # also the operations of each phase, the most frequent first

On a GPU every such operation is a kernel launch (or an allocation, a copy, a collective); at the batch sizes that
fit, this network's step on one H200 is bound by how many it issues from Python, not by its arithmetic. Counting
them needs no GPU: a TorchDispatchMode sees every operation below autograd and autocast, on the CPU as on a GPU.

(a) seed:    the seed's step: fp32, DDP, Adam(foreach=True) as on a GPU, plain cross-entropy, the batch copied in
             (its DataLoader prepares images in worker processes on the host: no launches).
(b) project: `train_distribute.train_epoch` with the default settings (muon, bf16 autocast, channels_last, label
             smoothing, augmentation on the device, COMPILE off), one rank in a process group, DDP in the path;
             bf16 autocast on even where this CPU would choose fp32, as on a GPU.
Each is counted over its second epoch (the first builds optimizer state and DDP's buckets). A phase is where in the
step loop the operation starts: batch (cutting, cropping, flipping, normalising and copying it), forward (network
and loss), backward (with DDP's all-reduce), optimizer (zero_grad and step), metrics (the loss and accuracy sums).
"""

import argparse
import linecache
import sys
from collections import Counter
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import distribute_tools
import muon
import train_distribute as td
from distribute_tools import DistInfo
from resnet import ResNet
from safeguards import files, settings

PHASES = ("batch", "forward", "backward", "optimizer", "metrics", "other")
# Which phase a line of a step loop belongs to: the first word found in the line's text decides.
LINE_WORDS = {"optimizer": "optimizer", "backward": "backward", "batches": "batch", "chunk": "batch", ".to(": "batch"}
LINE_WORDS |= {"sums": "metrics", "model(": "forward", "loss_fn(": "forward"}


def is_view(op: torch._ops.OpOverload) -> bool:
    """An operation that returns an alias of its input without writing it (view, transpose, detach, ...)."""
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(TorchDispatchMode):
    """Counts the non-view operations, by the phase of the step loop's line that they start from."""

    def __init__(self, *loops: str) -> None:
        super().__init__()
        self.loops = loops  # the names of the step loop's functions (names: the tests wrap train_epoch)
        self.phases: Counter = Counter()
        self.ops: Counter = Counter()

    def phase(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_name not in self.loops:
            frame = frame.f_back
        if frame is None:
            return "other"
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        return next((phase for word, phase in LINE_WORDS.items() if word in line), "other")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_view(func):
            phase = self.phase()
            self.phases[phase] += 1
            self.ops[phase, func.name()] += 1
        return func(*args, **(kwargs or {}))


def join_group() -> DistInfo:
    """One rank in a process group (gloo on the CPU, NCCL on a GPU), so that DDP runs as in a run."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend = distribute_tools.choose_device(0, 1, gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(0, 0, 1, 1, device, backend)


def project_counts(args: argparse.Namespace, info: DistInfo) -> OpCounter:
    """train_distribute's own epoch, with the settings a user runs (and bf16 autocast on, as on a GPU)."""
    given = [f"--width={args.width}", f"--batch_size={args.batch_size}", f"--accumulate={args.accumulate}"]
    given += [f"--synthetic_size={args.steps * args.batch_size}", "--dataset=synthetic", "--world_size=1", "--epochs=2"]
    cfg = settings.read(td, [*given, "--compile=False", "--precision=bf16"])
    run = td.build_run(cfg, info)
    run.precision = "bf16 autocast"  # as on a GPU, also where this CPU would train in fp32
    run.optimizer = muon.make_optimizer(cfg, run.model, td.peak_lr(cfg), info.device, True)
    files.PROGRESS_EVERY = float("inf")  # no progress lines between the figures
    td.train_epoch(run, 1)
    with OpCounter("train_epoch", "train_step") as counter:
        td.train_epoch(run, 2)
    return counter


def seed_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, device: torch.device, parts: int
) -> None:
    """The seed's training loop; with `parts` micro-batches a step, as a seed user would accumulate gradients."""
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        for i, (x_part, y_part) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            with model.no_sync() if i < parts - 1 else nullcontext():
                loss = loss_fn(model(x_part), y_part)
                (loss / parts if parts > 1 else loss).backward()  # the seed itself: no division
        optimizer.step()


def seed_counts(args: argparse.Namespace, info: DistInfo) -> OpCounter:
    torch.manual_seed(0)
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    model = DistributedDataParallel(ResNet(args.width, seed=True).to(info.device), device_ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    pinned = info.device.type == "cuda"
    batches = [
        (torch.randn(args.batch_size, 3, 32, 32, pin_memory=pinned), torch.randint(10, (args.batch_size,)))
        for _ in range(args.steps)
    ]
    seed_epoch(model, optimizer, batches, info.device, args.accumulate)
    with OpCounter("seed_epoch") as counter:
        seed_epoch(model, optimizer, batches, info.device, args.accumulate)
    return counter


def per_step(counter: OpCounter, steps: int) -> SimpleNamespace:
    figures = {phase: counter.phases[phase] / steps for phase in PHASES}
    return SimpleNamespace(total=sum(figures.values()), **figures)


def report(name: str, figures: SimpleNamespace) -> str:
    phases = "  ".join(f"{phase} {getattr(figures, phase):6.1f}" for phase in PHASES)
    return f"{name:<12} {figures.total:7.1f} ops/step   {phases}"


def measure(args: argparse.Namespace) -> tuple[SimpleNamespace, SimpleNamespace, OpCounter, OpCounter]:
    """(seed, project) ops per step by phase, and their counters. Joins and leaves a one-rank process group."""
    info = join_group()
    try:
        seed, project = seed_counts(args, info), project_counts(args, info)
    finally:
        dist.destroy_process_group()
    return per_step(seed, args.steps), per_step(project, args.steps), seed, project


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch (one rank)")
    parser.add_argument("--steps", type=int, default=4, help="steps of the counted epoch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step (ACCUMULATE), both")
    parser.add_argument("--ops", action="store_true", help="also list each phase's operations")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    seed, project, seed_counter, project_counter = measure(args)
    print(f"torch {torch.__version__} | width {args.width}, batch {args.batch_size}, {args.steps} steps an epoch")
    print(report("(a) seed", seed))
    print(report("(b) project", project))
    print(f"project / seed: {project.total / seed.total:.2f}")
    if args.ops:
        for name, counter in (("seed", seed_counter), ("project", project_counter)):
            for (phase, op), count in counter.ops.most_common():
                print(f"{name:<8} {phase:<10} {count / args.steps:7.1f}  {op}")


if __name__ == "__main__":
    main()
