"""The loaders side by side on real images (an image folder of photos, such as CIFAR-10 as JPEGs), in one run:

    python -m benchmarks.loader --data_dir DIR                 # memory, then speed: about 10 minutes on 2 cores
    python -m benchmarks.loader --data_dir DIR --only speed --runs 64x32 --pipelines stream memory --world_size 1

memory  The peak memory of a whole run, launcher, ranks and DataLoader workers together: the sum of their PSS
        (/proc/PID/smaps_rollup, shared pages split between the processes that share them), sampled every 0.1 s
        while `python train_distribute.py` trains an epoch at width 4 on 2,000 and on 8,000 (--memory_images)
        training images of DIR resized to 96x96 and saved again as JPEGs (quality 90), with 500 (--test_images)
        test images; once per loader. The memory loader decodes every image as its ranks start: that counts.
speed   Training images/s of 2 ranks (--world_size) at width 64 (32x32 images) and width 8 (32x32 and 96x96): stream,
        memory and the seed's pipeline (torchvision's ImageFolder, ToTensor and Normalize per image, a DataLoader
        with a DistributedSampler and no workers, as the seed has it), each with the project's training step;
        and the share of that time spent waiting for DataLoader batches (the stream loader's workers, the seed's
        in-process decoding; the memory loader has none). Crops, flips and normalisation count as the step's:
        both loaders do them on the device alike (the seed's pipeline has none). The images: the first --images
        of DIR/train as they are (32x32) or resized to 96x96. Each run lasts about --seconds; each pipeline runs
        --repeats times, in turns, and the fastest run counts (the machine disturbs the others more). Each speed
        run's ranks are forked from this process (torch's elastic agent, as `python train_distribute.py` starts
        them) and train with train_distribute.build_run and train_step; data.reader is timed in them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
import distribute_tools  # noqa: E402
import train_distribute as td  # noqa: E402
from safeguards import failures, settings  # noqa: E402

PIPELINES = ("stream", "memory", "seed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="an image folder: DIR/train/<class>/<image>, DIR/test/...")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "loader-benchmark"), help="copies")
    parser.add_argument("--only", choices=("memory", "speed"), help="one of the two measurements")
    parser.add_argument("--images", type=int, default=5_120, help="training images of the speed runs")
    parser.add_argument("--batch_size", type=int, default=128, help="global batch of the speed runs")
    parser.add_argument("--seconds", type=float, default=20, help="timed seconds per speed run (3 untimed steps first)")
    parser.add_argument("--repeats", type=int, default=2, help="speed runs per pipeline, in turns; the best counts")
    parser.add_argument("--runs", nargs="+", default=["64x32", "8x32", "8x96"], help="speed runs: WIDTHxSIZE")
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--world_size", type=int, default=2, help="ranks of the speed runs (GPUs: one per GPU)")
    parser.add_argument("--memory_images", type=int, nargs=2, default=[2_000, 8_000], help="training images of the "
                        "two memory runs")  # fmt: skip
    parser.add_argument("--test_images", type=int, default=500, help="test images of every run")
    return parser.parse_args()


# ----------------------------------------------------------------------------- the images


def copy_of(data_dir: Path, work: Path, train: int, test: int, size: int) -> Path:
    """The first `train` and `test` images of data_dir (in turns over the classes), linked (size 0: as they are)
    or resized to size x size and saved again as JPEGs; made once (in a temporary folder, then renamed)."""
    from PIL import Image

    target = work / f"{train}-{test}-{size or 'as-is'}"
    if target.exists():
        return target
    work.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=work))
    for split, count in (("train", train), ("test", test)):
        files = [sorted(c.iterdir()) for c in sorted(p for p in (data_dir / split).iterdir() if p.is_dir())]
        in_turns = [f for group in zip_longest(*files) for f in group if f is not None][:count]
        if len(in_turns) < count:
            sys.exit(f"{data_dir / split} holds {len(in_turns)} images, fewer than the {count} this benchmark needs")
        for source in in_turns:
            destination = partial / split / source.parent.name / source.name
            destination.parent.mkdir(parents=True, exist_ok=True)
            if size:
                Image.open(source).convert("RGB").resize((size, size), Image.BILINEAR).save(destination, quality=90)
            else:
                destination.symlink_to(source)
    partial.rename(target)
    return target


# ----------------------------------------------------------------------------- memory


def tree_pss_kb(root: int) -> int:
    """The summed PSS of `root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        frontier += children.get(pid, [])
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            total += next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue  # it has just ended
    return total


def peak_memory_mb(folder: Path, loader: str, work: Path) -> float:
    with tempfile.TemporaryDirectory(dir=work) as out:
        command = [sys.executable, str(ROOT / "train_distribute.py"), "--dataset=imagefolder", f"--data_dir={folder}",
                   f"--loader={loader}", "--image_size=96", "--width=4", "--batch_size=64", "--epochs=1",
                   "--world_size=2", f"--output_dir={out}"]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        peak = 0
        while process.poll() is None:
            peak = max(peak, tree_pss_kb(process.pid))
            time.sleep(0.1)
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed with exit code {process.returncode}")
    return peak / 1024


def measure_memory(data_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    small, big = args.memory_images
    sets = {train: copy_of(data_dir, work, train, args.test_images, 96) for train in (small, big)}
    peaks = {(loader, train): peak_memory_mb(folder, loader, work) for loader in ("stream", "memory")
             for train, folder in sets.items()}  # fmt: skip
    print("\npeak PSS of the whole run (MB), 96x96 images, 2 ranks on the CPU")
    print(f"{'loader':8} {f'{small:,} images':>13} {f'{big:,} images':>13} {'growth':>8}")
    for loader in ("stream", "memory"):
        low, high = peaks[(loader, small)], peaks[(loader, big)]
        print(f"{loader:8} {low:13,.0f} {high:13,.0f} {high / low - 1:8.0%}")
    return {f"{loader} {train}": mb for (loader, train), mb in peaks.items()}


# ----------------------------------------------------------------------------- speed


class TimedBatches:
    """A DataLoader whose every batch is timed: the seconds a rank waits for its workers (or, without workers,
    for the decoding in its own process)."""

    seconds = 0.0  # of every TimedBatches of this process, since the last reset

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # the DataLoader's sampler, dataset, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            TimedBatches.seconds += time.perf_counter() - asked
            yield batch


def seed_batches(folder: Path, local_batch: int, info: distribute_tools.DistInfo) -> Iterator:
    """The seed's pipeline on an image folder: per image PIL -> ToTensor -> Normalize, no workers."""
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchvision.datasets import ImageFolder

    normalise = T.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    dataset = ImageFolder(str(folder / "train"), T.Compose([T.ToTensor(), normalise]))  # the files are size x size
    sampler = DistributedSampler(dataset, info.world_size, info.rank, shuffle=True, seed=0, drop_last=True)
    for x, y in TimedBatches(DataLoader(dataset, local_batch, sampler=sampler, num_workers=0, drop_last=True)):
        yield x.to(info.device).contiguous(memory_format=torch.channels_last), y.to(info.device)


def speed_rank(argv: list, pipeline: str, seconds: float, result: str) -> None:
    """One rank of a speed run (started by run_distribute): its line and exit code as the project's ranks."""
    failures.run_rank(lambda: speed_worker(argv, pipeline, seconds, result))


def speed_worker(argv: list, pipeline: str, seconds: float, result: str) -> None:
    reader = data.reader
    data.reader = lambda *args, **kwargs: TimedBatches(reader(*args, **kwargs))  # the stream loader's DataLoaders
    info = distribute_tools.setup()
    facts = timed_steps(settings.read(td, argv), info, pipeline, seconds)
    if info.is_main:
        Path(result).write_text(json.dumps(facts))
    distribute_tools.cleanup()


def timed_steps(cfg: Any, info: distribute_tools.DistInfo, pipeline: str, seconds: float) -> dict:
    """3 untimed steps, then as many as fill about `seconds`: images/s, and the share of that time spent waiting
    for DataLoader batches (crops, flips and normalisation are the step's, on either loader). The run ends with
    this call, before the group is left."""
    run = td.build_run(cfg, info)
    if pipeline == "seed":
        batches = seed_batches(Path(cfg.DATA_DIR), cfg.BATCH_SIZE // info.world_size, info)
    else:
        batches = run.train_data.train_batches(cfg.BATCH_SIZE, info.world_size, info.rank, cfg.SEED, epoch=1)
    sums, loss_fn = torch.zeros(3, device=info.device), nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING)

    def synchronize() -> None:
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)

    def steps(count: int) -> float:
        synchronize()
        started, TimedBatches.seconds = time.perf_counter(), 0.0
        for _ in range(count):
            x, y = next(batches)
            td.train_step(run, x, y, 0.1, loss_fn, sums)
        synchronize()
        return time.perf_counter() - started

    count = torch.tensor(
        [max(3, min(run.train_data.steps_per_epoch(cfg.BATCH_SIZE) - 3, round(3 * seconds / steps(3))))],
        device=info.device,
    )
    torch.distributed.broadcast(count, src=0)  # every rank takes as many steps
    facts = torch.tensor([steps(int(count.item())), TimedBatches.seconds], dtype=torch.float64, device=info.device)
    torch.distributed.all_reduce(facts, op=torch.distributed.ReduceOp.MAX)
    speed = int(count.item()) * cfg.BATCH_SIZE / facts[0].item()
    return {"images_per_second": speed, "wait_share": facts[1].item() / facts[0].item()}


def measure_speed(data_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    """Each pipeline --repeats times, in turns; the fastest of each (the one least disturbed by the machine)."""
    runs = [tuple(int(n) for n in run.split("x")) for run in args.runs]  # (width, image size)
    folders = {size: copy_of(data_dir, work, args.images, args.test_images, 0 if size == 32 else size)
               for _, size in runs}  # fmt: skip
    results: dict[tuple, dict] = {}
    for width, size in runs:
        for _, pipeline in sorted((repeat, p) for repeat in range(args.repeats) for p in args.pipelines):
            loader = "stream" if pipeline == "seed" else pipeline  # seed: the project's loader is built, never read
            argv = ["--dataset=imagefolder", f"--data_dir={folders[size]}", f"--image_size={size}",
                    f"--width={width}", f"--batch_size={args.batch_size}", f"--world_size={args.world_size}",
                    f"--loader={loader}"]  # fmt: skip
            with tempfile.NamedTemporaryFile(suffix=".json") as result:
                try:
                    distribute_tools.run_distribute(speed_rank, args.world_size, argv, pipeline, args.seconds,
                                                    result.name)  # fmt: skip
                except ChildFailedError as e:
                    sys.exit(f"the {pipeline} run at width {width}, {size}x{size} failed: {failures.outcome(e)[1]}")
                measured = json.loads(Path(result.name).read_text())
            best = results.get((width, size, pipeline))
            if best is None or measured["images_per_second"] > best["images_per_second"]:
                results[(width, size, pipeline)] = measured
    print(f"\ntraining images/s (share of the time spent waiting for DataLoader batches), {args.world_size} rank(s), "
          f"global batch {args.batch_size}, best of {args.repeats}")  # fmt: skip
    ratio = "stream/memory" if {"stream", "memory"} <= set(args.pipelines) else ""
    print(f"{'width, size':14}" + "".join(f"{p:>18}" for p in args.pipelines) + f"{ratio:>15}")
    for width, size in runs:
        cells = {p: results[(width, size, p)] for p in args.pipelines}
        line = "".join(f"{c['images_per_second']:10,.1f} ({c['wait_share']:5.1%})" for c in cells.values())
        if ratio:
            line += f"{cells['stream']['images_per_second'] / cells['memory']['images_per_second']:15.2f}"
        print(f"{width:>5}, {size}x{size:<5}{line}")
    return {f"{w} {s} {p}": r for (w, s, p), r in results.items()}


def main() -> None:
    args = parse_args()
    data_dir, work = Path(args.data_dir).resolve(), Path(args.work)
    kind = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in Path("/proc/cpuinfo").read_text()]
    print(f"{len(os.sched_getaffinity(0))} cores, CPU bf16: {', '.join(kind) or 'none (AVX2 or older)'}, "
          f"torch {torch.__version__}")  # fmt: skip
    if args.only != "speed":
        measure_memory(data_dir, work, args)
    if args.only != "memory":
        measure_speed(data_dir, work, args)


if __name__ == "__main__":
    main()
