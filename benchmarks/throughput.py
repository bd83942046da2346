"""Training throughput: the seed's pipeline against this project's, in one run on one machine.

    python -m benchmarks.throughput                                  # CPU: 2 gloo ranks, width 64, batch 256
    python -m benchmarks.throughput --world_size=1 --batch_size=512 --steps=60 --warmup=10   # one GPU
    python -m benchmarks.throughput --steps 4 --width 8 --results out.json   # quick; figures saved as they come

(a) seed:      the seed's pipeline re-implemented: DataLoader + DistributedSampler, per-image PIL -> ToTensor
               -> Normalize, fp32, Adam, DDP, no loader workers (as the seed runs it).
(a') seed at its best: the same with loader workers, pinned memory and non-blocking copies: a fair baseline.
(a'') seed at its best in bf16: (a') with bf16 autocast and the network and batches in channels_last, otherwise
               unchanged: the baseline for the project's precision and layout.
(b) project:   `python train_distribute.py --dataset=synthetic ...` as a user runs it, 2 epochs of --steps steps
               each; its figure is the images_per_second that the CSV reports for epoch 2 (epoch 1 is the warm-up).
               Also: launch to first epoch end, the wall clock from starting the command to its `epoch 1/2` line
               (interpreter, imports, checks, data, ranks, network, epoch 1's steps and evaluation), and the part of
               it before epoch 1 (that figure less epoch 1's epoch_seconds): the time to the first step.
(b') project, compiled: the same command with --compile=True (on GPUs by default; --compiled yes/no decides). Its
               compile time: the seconds its epoch 1 takes beyond the eager run's epoch 1.
(c) ceiling:   one process, all cores (or one GPU per rank), no DDP and no data loading: forward + backward +
               step of the same network in the project's precision, layout and cudnn setting on one fixed
               batch. (b)/(c) is the share of the ceiling the project reaches (on a GPU the seed can beat it).
Same network, global batch and world size for (a), (a'), (a'') and (b). Prints images/s, ratios to (a') and (a''),
peak memory (the largest rank's: GPU memory allocated, or resident memory on CPU) and, on a GPU with a known peak,
model FLOPs utilisation (training FLOPs per image counted by torch's FlopCounterMode, against the dense bf16 peak).
The seed's ranks are forked from this process before it computes anything or sets any torch setting; the project
runs as its own command. --results FILE keeps every figure so far in a JSON file, rewritten after each one.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import distribute_tools
import muon
import train_distribute as td
from data import make_synthetic
from distribute_tools import choose_device
from resnet import ResNet
from safeguards import failures, files, settings, start
from safeguards.failures import UserError

ROOT = Path(__file__).resolve().parent.parent
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks, for the MFU line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--world_size", type=int, default=0, help="0: every GPU, or 2 CPU processes")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (seed pipeline and ceiling)")
    parser.add_argument("--compiled", choices=["auto", "yes", "no"], default="auto", help="(b') too; auto: on GPUs")
    parser.add_argument("--precision", default="auto", help="(b) and (c) in this PRECISION (fp32 even if bf16 is fast)")
    parser.add_argument("--skip_seed", action="store_true", help="only (b) and (c)")
    parser.add_argument("--optimizer", default="", help="(b) and (c) with this OPTIMIZER, not the default one")
    parser.add_argument("--results", default="", help="a JSON file of the figures so far, rewritten after each one")
    return parser.parse_args()


class Results:
    """Each figure printed as it comes, and kept in --results (rewritten whole: a cut run leaves the figures so far)."""

    def __init__(self, path: str, flops_per_image: float, peak_tflops: float | None, world_size: int) -> None:
        self.path, self.flops, self.peak, self.world_size = path, flops_per_image, peak_tflops, world_size
        self.figures: dict[str, Any] = {}

    def mfu(self, images_per_second: float) -> str:
        if not self.peak:
            return ""
        return f"   MFU {100 * images_per_second * self.flops / (self.world_size * self.peak * 1e12):4.1f}%"

    def add(self, key: str, line: str, **figures: Any) -> None:
        print(line + (self.mfu(figures["images_per_second"]) if "images_per_second" in figures else ""), flush=True)
        self.figures[key] = figures
        if self.path:
            Path(self.path).write_text(json.dumps(self.figures, indent=1))


def gpu_count() -> int:
    """GPUs, counted by NVML: the CUDA runtime's count in this process would keep the seed's ranks, forked from it,
    from using CUDA ("Cannot re-initialize CUDA in forked subprocess")."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cores() -> int:
    return len(os.sched_getaffinity(0))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (GPUs run asynchronously; CPUs have nothing queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- (a) the seed's pipeline


class PilImages(Dataset):
    """What torchvision's CIFAR10 does per item: a PIL image from uint8 HWC pixels, then the transform."""

    def __init__(self, pixels_hwc: torch.Tensor, labels: torch.Tensor) -> None:
        import torchvision.transforms as T

        self.pixels, self.labels = pixels_hwc.numpy(), labels.tolist()
        self.transform = T.Compose([T.ToTensor(), T.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.pixels[i])), self.labels[i]


def seed_pipeline_rank(args: argparse.Namespace, best: bool, result_path: str, bf16: bool = False) -> None:
    """One rank of the seed's pipeline (started by run_distribute): its line and exit code as the project's ranks."""
    failures.run_rank(lambda: seed_pipeline(args, best, result_path, bf16))


def seed_pipeline(args: argparse.Namespace, best: bool, result_path: str, bf16: bool = False) -> None:
    """The seed's training loop; with `bf16` (a''), in bf16 autocast with network and batches in channels_last."""
    info = distribute_tools.setup()
    images, labels = make_synthetic((args.warmup + args.steps) * args.batch_size, seed=0, split=0)  # uint8 NHWC
    dataset = PilImages(images, labels)
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank)
    workers = max(1, cores() // info.local_world_size) if best else 0
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size // info.world_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=best and info.device.type == "cuda",
        persistent_workers=workers > 0,
    )
    layout = torch.channels_last if bf16 else torch.contiguous_format
    model = ResNet(args.width, seed=True).to(info.device, memory_format=layout)
    model = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    loss_fn, optimizer = nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(info.device, non_blocking=best, memory_format=layout), y.to(info.device, non_blocking=best)
        with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == args.warmup - 1:  # the timed window starts before the first timed batch is loaded
            synchronize(info.device)
            started = time.perf_counter()
    synchronize(info.device)
    seconds = time.perf_counter() - started
    memory = torch.tensor([files.peak_memory_mb(info.device)], device=info.device)
    torch.distributed.all_reduce(memory, op=torch.distributed.ReduceOp.MAX)  # DDP: every rank; the largest, as the CSV
    if info.is_main:
        Path(result_path).write_text(f"{args.steps * args.batch_size / seconds} {memory.item()}")
    del loader, model, optimizer  # the loader's workers end before the group is left
    distribute_tools.cleanup()


def run_seed_pipeline(args: argparse.Namespace, world_size: int, best: bool, bf16: bool = False) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "seed.txt")
        try:
            distribute_tools.run_distribute(seed_pipeline_rank, world_size, args, best, result, bf16)
        except ChildFailedError as e:
            sys.exit(f"the seed pipeline failed: {failures.outcome(e)[1]}")
        speed, memory = Path(result).read_text().split()
    return float(speed), float(memory)


# ----------------------------------------------------------------------------- (b) this project


def run_project(args: argparse.Namespace, world_size: int, compile: bool) -> dict:
    """`python train_distribute.py` on synthetic data: epoch 2's images/s and peak memory from its CSV, its
    precision from its first line, and the wall clock from launch to its first epoch line."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-u", str(ROOT / "train_distribute.py"), "--dataset=synthetic", "--epochs=2"]
        command += [f"--synthetic_size={args.steps * args.batch_size}", f"--width={args.width}", f"--compile={compile}"]
        command += [f"--batch_size={args.batch_size}", f"--world_size={world_size}", f"--output_dir={out}"]
        command += [f"--precision={args.precision}", *optimizer_setting(args)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RESNET_DDP_", "TORCHELASTIC_"))}
        started, first_epoch, lines = time.monotonic(), None, []
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        ) as process:
            for line in process.stdout:
                lines.append(line.rstrip())
                if first_epoch is None and line.startswith("epoch 1/"):
                    first_epoch = time.monotonic() - started
        if process.returncode != 0 or first_epoch is None:
            sys.exit(f"the project's training failed (exit {process.returncode}): " + " | ".join(lines[-3:]))
        rows = pd.read_csv(os.path.join(out, files.CSV_NAME))
    precision = next((re.search(r"\| (bf16|fp16|fp32)", line)[1] for line in lines if "| global batch" in line), "?")
    last, epoch_1 = rows.iloc[-1], float(rows["epoch_seconds"].iloc[0])
    return {
        "images_per_second": float(last["images_per_second"]),
        "peak_memory_mb": float(last["peak_memory_mb"]),
        "precision": precision,
        "first_epoch_end": first_epoch,
        "first_step": first_epoch - epoch_1,
        "first_epoch_seconds": epoch_1,
    }


def optimizer_setting(args: argparse.Namespace) -> list[str]:
    return [f"--optimizer={args.optimizer}"] if args.optimizer else []


# ----------------------------------------------------------------------------- (c) the compute ceiling


def compute_ceiling(args: argparse.Namespace, memory_format: torch.memory_format) -> float:
    """Images/s of forward + backward + step alone in one process."""
    device, _ = choose_device(0, 1, gpu_count())
    torch.set_num_threads(cores())
    torch.backends.cudnn.benchmark = True  # as the project sets it
    model = ResNet(args.width).to(device, memory_format=memory_format)
    precision = start.precision(device, args.precision, model, 32)  # as the run's
    cfg = settings.read(td, [f"--batch_size={args.batch_size}", *optimizer_setting(args)])
    optimizer = muon.make_optimizer(cfg, model, td.peak_lr(cfg), device, precision.startswith("bf16"))
    x = torch.randn(args.batch_size, 3, 32, 32, device=device).contiguous(memory_format=memory_format)
    y = torch.randint(10, (args.batch_size,), device=device)
    autocast = td.autocast(device, precision)

    def step() -> None:
        with autocast:
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(max(args.warmup, 1)):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    return args.steps * args.batch_size / (time.perf_counter() - started)


def training_flops_per_image(width: int, batch: int = 2) -> float:
    """FLOPs of one training image (forward and backward) counted by torch's FlopCounterMode on the meta device: no
    memory, no computation, nothing set up that the seed's forked ranks would inherit."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model, x, y = ResNet(width), torch.randn(batch, 3, 32, 32), torch.randint(10, (batch,))
        with FlopCounterMode(display=False) as counter:
            nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def cpu_kind() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU"
    native = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]
    return f"CPU with {'+'.join(native)}" if native else "CPU without native bf16 (AVX2 or older)"


def gpu_facts() -> tuple[str, bool]:
    """The GPU's name and whether it computes bf16 fast (Ampere on), from nvidia-smi: torch's answers would initialise
    CUDA here, which the seed's ranks, forked from this process, then could not use ("Cannot re-initialize CUDA in
    forked subprocess"). tests/test_benchmarks.py checks that nothing here initialises CUDA before the fork."""
    query = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
    line = (subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines() or ["a GPU"])[0]
    name, _, capability = line.rpartition(",")
    try:
        return name.strip(), float(capability) >= 8.0
    except ValueError:  # a driver that does not know compute_cap: bf16 assumed fast (every GPU since 2020)
        return line.strip(), True


def main() -> None:
    args = parse_args()
    try:
        world_size = args.world_size or gpu_count() or 2
        optimizer = settings.read(td, optimizer_setting(args)).OPTIMIZER
    except UserError as e:
        sys.exit(f"error: {e}")
    device, backend = choose_device(0, 1, gpu_count())
    fast = start.precision(device, "auto", torch.nn.Identity(), 8).startswith("bf16") if device.type == "cpu" else 0
    name, bf16_fast = gpu_facts() if device.type == "cuda" else (f"{cpu_kind()}, {cores()} cores", fast)
    compiled = args.compiled == "yes" or (args.compiled == "auto" and device.type == "cuda")
    print(
        f"machine: {name} | torch {torch.__version__} | {world_size} rank(s), {backend} | width {args.width}, "
        f"global batch {args.batch_size}, {args.steps} timed steps | (b) and (c) with {optimizer}",
        flush=True,
    )
    peak = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)
    flops = training_flops_per_image(args.width)
    results = Results(args.results, flops, peak, world_size)
    if peak:
        print(f"MFU: {flops / 1e9:.2f} GFLOP per training image against {peak:.0f} TFLOP/s per GPU (dense bf16)")
    speeds: dict[str, float] = {}
    seeds = [("a", "(a)   seed pipeline", False, False), ("a'", "(a')  seed at its best", True, False)]
    if bf16_fast:  # elsewhere the project trains in fp32 too, and emulated bf16 is no baseline
        seeds += [("a''", "(a'') seed at its best, bf16 + channels_last", True, True)]
    for key, label, best, bf16 in [] if args.skip_seed else seeds:  # before any computation here: forked from here
        speeds[key], memory = run_seed_pipeline(args, world_size, best, bf16)
        line = f"{label:<44}{speeds[key]:10,.0f} images/s   peak memory {memory:8,.0f} MiB"
        results.add(key, line, images_per_second=speeds[key], peak_memory_mb=memory)
    projects = [("b", "(b)   this project", False), ("b'", "(b')  this project, compiled", True)]
    for key, label, compile in projects[: 1 + compiled]:
        ours = run_project(args, world_size, compile)
        speeds[key] = ours["images_per_second"]
        line = f"{label:<44}{speeds[key]:10,.0f} images/s   peak memory {ours['peak_memory_mb']:8,.0f} MiB"
        line += f" ({ours['precision']})"
        if compile:
            ours["compile_seconds"] = ours["first_epoch_seconds"] - results.figures["b"]["first_epoch_seconds"]
            line += f"; compile time {ours['compile_seconds']:.1f} s (epoch 1 beyond the eager run's)"
        results.add(key, line, **ours)
        launch = f"launch to first epoch end {ours['first_epoch_end']:.1f} s (the command's wall clock to its epoch 1"
        print(f"      {launch} line), of which before epoch 1's first step {ours['first_step']:.1f} s", flush=True)
    # One GPU per rank: the ceiling of N GPUs is N times one GPU's. CPU ranks share the cores the ceiling used.
    scale = world_size if device.type == "cuda" else 1
    speeds["c"] = compute_ceiling(args, torch.channels_last) * scale  # the project's layout
    other = compute_ceiling(args, torch.contiguous_format) * scale
    label = "(c)   compute ceiling"
    line = f"{label:<44}{speeds['c']:10,.0f} images/s   (the project's layout; contiguous: {other:,.0f})"
    results.add("c", line, images_per_second=speeds["c"], contiguous_images_per_second=other)
    pairs = [(b, a) for b in ("b", "b'") for a in ("a", "a'", "a''") if b in speeds and a in speeds] + [("b", "c")]
    results.figures["ratios"] = ratios = {f"({b})/({a})": speeds[b] / speeds[a] for b, a in pairs}
    print(" | ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()), flush=True)
    results.add("epoch", "epoch of 50,000 images: " + ", ".join(f"({k}) {50_000 / v:.2f} s" for k, v in speeds.items()))


if __name__ == "__main__":
    main()
