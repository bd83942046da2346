"""Training throughput: the seed's pipeline against this project's, in one run on one machine.

    python benchmarks/throughput.py                                  # CPU: 2 gloo ranks, width 64, batch 256
    python benchmarks/throughput.py --world_size=1 --batch_size=512 --steps=50 --warmup=10   # one GPU

(a) seed:    the seed's pipeline re-implemented: DataLoader + DistributedSampler, per-image PIL -> ToTensor
             -> Normalize, fp32, Adam, DDP. Timed over --steps steps after --warmup steps.
(b) project: train_distribute.py itself on synthetic data, 2 epochs of --steps steps each; its figure is
             the images_per_second that the CSV reports for epoch 2 (epoch 1 is the warm-up).
(c) ceiling: one process, all cores, no DDP and no data loading: forward + backward + step of the same
             network in the project's precision and layout on one fixed batch. (b)/(c) shows what data
             handling and DDP cost.
Same network, global batch and world size for (a) and (b). Prints images/s, the ratio, and peak memory
(the largest rank's: GPU memory allocated, or resident memory on CPU).
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import train_distribute as td  # noqa: E402
from data import make_synthetic  # noqa: E402
from distribute_tools import (  # noqa: E402
    UserError, bf16_is_fast, cleanup, cpu_cores, device_and_backend, resolve_world_size, run_distribute, setup,
)
from resnet import ResNet  # noqa: E402

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks, for the MFU line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=256, help="global batch, split over the ranks")
    parser.add_argument("--world_size", type=int, default=0, help="0: every GPU, or 2 CPU processes")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (seed pipeline and ceiling)")
    parser.add_argument("--compile", action="store_true", help="run (b) with COMPILE=True")
    return parser.parse_args()


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


def seed_pipeline_worker(rank: int, world_size: int, args: argparse.Namespace, result_path: str) -> None:
    d = setup(rank, world_size)
    images = make_synthetic((args.warmup + args.steps) * args.batch_size, seed=0, split=0)
    dataset = PilImages(images.images.permute(0, 2, 3, 1).contiguous(), images.labels)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler, num_workers=0,
                        pin_memory=d.device.type == "cuda")
    model = ResNet(args.width).to(d.device)
    model = DistributedDataParallel(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    loss_fn, optimizer = nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), lr=1e-3)
    started = None
    for step, (x, y) in enumerate(loader):
        if step == args.warmup:
            td.synchronize(d.device)
            started = time.perf_counter()
        x, y = x.to(d.device), y.to(d.device)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    td.synchronize(d.device)
    seconds = time.perf_counter() - started
    memory = td.peak_memory_mb(d.device)
    if d.is_main:
        Path(result_path).write_text(f"{args.steps * args.batch_size / seconds} {memory}")
    cleanup(finished=True)


def run_seed_pipeline(args: argparse.Namespace, world_size: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "seed.txt")
        if run_distribute(seed_pipeline_worker, world_size, args, result) != 0:
            sys.exit("the seed pipeline failed")
        speed, memory = Path(result).read_text().split()
    return float(speed), float(memory)


# ----------------------------------------------------------------------------- (b) this project


def run_project(args: argparse.Namespace, world_size: int) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as out:
        cfg = td.read_config([
            "--dataset=synthetic", f"--synthetic_size={args.steps * args.batch_size}", f"--width={args.width}",
            f"--batch_size={args.batch_size}", f"--world_size={world_size}", "--epochs=2", f"--output_dir={out}",
            f"--compile={args.compile}",
        ])
        if run_distribute(td.main_worker, world_size, cfg) != 0:
            sys.exit("the project's training failed")
        epoch = pd.read_csv(os.path.join(out, "pytorch_res.csv")).iloc[-1]
        precision = "bf16" if cfg.AMP and bf16_is_fast(device_and_backend(0)[0]) else "fp32"
        return float(epoch["images_per_second"]), float(epoch["peak_memory_mb"]), precision


# ----------------------------------------------------------------------------- (c) the compute ceiling


def compute_ceiling(args: argparse.Namespace) -> tuple[float, float]:
    """Images/s of forward + backward + step alone in one process; and FLOPs per training image."""
    device, _ = device_and_backend(0)
    torch.set_num_threads(cpu_cores())
    model = ResNet(args.width).to(device, memory_format=torch.channels_last)
    optimizer = td.make_optimizer(td.read_config([]), model, device)  # the project's optimizer and kernels
    x = torch.randn(args.batch_size, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(10, (args.batch_size,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_is_fast(device))

    def step() -> None:
        with autocast:
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    flops_per_image = counter.get_total_flops() / args.batch_size
    for _ in range(args.warmup):
        step()
    td.synchronize(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    td.synchronize(device)
    return args.steps * args.batch_size / (time.perf_counter() - started), flops_per_image


def main() -> None:
    args = parse_args()
    os.environ.pop("MASTER_PORT", None)
    try:
        world_size = resolve_world_size(args.world_size)
    except UserError as e:
        sys.exit(f"error: {e}")
    device, backend = device_and_backend(0)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {cpu_cores()} cores"
    print(f"machine: {name} | torch {torch.__version__} | {world_size} rank(s), {backend} | width {args.width}, "
          f"global batch {args.batch_size}, {args.steps} timed steps", flush=True)
    seed_speed, seed_memory = run_seed_pipeline(args, world_size)
    print(f"(a) seed pipeline     {seed_speed:10,.0f} images/s   peak memory {seed_memory:8,.0f} MiB per rank", flush=True)
    ours_speed, ours_memory, precision = run_project(args, world_size)
    print(f"(b) this project      {ours_speed:10,.0f} images/s   peak memory {ours_memory:8,.0f} MiB per rank "
          f"({precision}{', compiled' if args.compile else ''})", flush=True)
    ceiling, flops = compute_ceiling(args)
    # One GPU per rank: the ceiling of N GPUs is N times one GPU's. CPU ranks share the cores the ceiling used.
    ceiling *= world_size if device.type == "cuda" else 1
    print(f"(c) compute ceiling   {ceiling:10,.0f} images/s   (1 process per GPU or all cores, no DDP, no data)")
    print(f"speed-up (b)/(a): {ours_speed / seed_speed:.2f}x | data + DDP overhead 1-(b)/(c): "
          f"{100 * (1 - ours_speed / ceiling):.1f}% | {flops / 1e9:.2f} GFLOP per training image")
    print(f"epoch of 50,000 images: seed {50_000 / seed_speed:.1f} s, project {50_000 / ours_speed:.2f} s")
    peak = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)
    if peak:
        mfu = ours_speed * flops / (world_size * peak * 1e12)
        print(f"model FLOPs utilisation (b): {100 * mfu:.1f}% of {peak:.0f} TFLOP/s per GPU")


if __name__ == "__main__":
    main()
