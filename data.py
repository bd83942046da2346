"""CIFAR-10, your image folder or generated images as each rank's batches, augmented and normalised on the device:
MemoryLoader (the split on the device, indexed) or StreamLoader (a larger folder: DataLoader + DistributedSampler)."""

import hashlib
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import warnings
from contextlib import nullcontext
from functools import cache, partial, reduce
from itertools import compress
from multiprocessing import forkserver, resource_tracker
from types import SimpleNamespace
from typing import Any

import filelock
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from distribute_tools import DistInfo
from safeguards.failures import KEPT, STOP_SIGNALS, UserError, first_line, ignore_stop_signals

# CIFAR-10's published statistics, 0..1 units (generated images are made alike: mean 0.5, std about 0.25)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
# Image folders: ImageNet's, as torchvision's models expect (the first BatchNorm absorbs a mismatch; no pass first)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SYNTHETIC_CLASSES = 10
EVAL_BATCH = 500  # test images per evaluation batch
UNREADABLE_STOP = 0.1  # a pass over an image folder with more unreadable files than this share stops the run
MEMORY_SHARE = 0.2  # image folders decoded take at most this share of a rank's RAM (twice, decoding) and GPU: in memory
IN_RANK_BYTES = 8 * 2**20  # NUM_WORKERS=-1: up to this size the rank decodes (9 MB/s) faster than workers start
# torchvision's IMG_EXTENSIONS, written out: importing torchvision costs every process that lists a folder 1.4 s of CPU
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def prepare(cfg: SimpleNamespace) -> None:
    """Download CIFAR-10 into DATA_DIR unless it is there: one process per folder at a time (a file lock), since ranks
    downloading at once corrupt the archive. An image folder: both splits must hold the same classes."""
    if cfg.DATASET == "imagefolder":
        train, test = set(list_folder(cfg.DATA_DIR, "train")[0]), set(test_split(cfg)[0])
        only = {"train": train - test, "test": test - train} if test else {}
        if differ := "; ".join(f"only in {split}/: {', '.join(sorted(c)[:5])}" for split, c in only.items() if c):
            raise UserError(f"{cfg.DATA_DIR}/train and test/ hold other classes ({differ}); give both the same folders")
    if cfg.DATASET != "cifar10":
        return
    if os.path.isdir(own := os.path.join(cfg.DATA_DIR, "train")) and any(e.is_dir() for e in os.scandir(own)):
        raise UserError(f"DATA_DIR {cfg.DATA_DIR} holds train/<class>/ folders, no CIFAR-10; add --dataset imagefolder")
    try:
        os.makedirs(cfg.DATA_DIR, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create DATA_DIR {cfg.DATA_DIR} ({e.strerror}); point --data_dir elsewhere") from None
    writable = os.access(cfg.DATA_DIR, os.W_OK)  # read-only: no lock, none needed
    with filelock.FileLock(os.path.join(cfg.DATA_DIR, ".cifar10.lock")) if writable else nullcontext():
        _cifar10(cfg.DATA_DIR, train=True, download=True)


def _cifar10(data_dir: str, train: bool, download: bool = False) -> Any:
    from torchvision.datasets import CIFAR10  # here: torchvision takes seconds to import, and only CIFAR-10 needs it

    try:
        return CIFAR10(data_dir, train=train)
    except RuntimeError:  # not there, or corrupt
        if not download:
            raise UserError(f"CIFAR-10 is missing or corrupt in {data_dir}; delete it there and rerun") from None
    socket.setdefaulttimeout(60)  # torchvision's download sets none (the process's default: no other socket uses it)
    try:
        return CIFAR10(data_dir, train=train, download=True)
    except Exception as e:
        how = f"offline, copy cifar-10-python.tar.gz into {data_dir}/ by hand and rerun, or use --dataset imagefolder"
        raise UserError(f"could not download CIFAR-10 into {data_dir} ({first_line(e)}); {how}") from None


def load(cfg: SimpleNamespace, info: DistInfo, memory_format: torch.memory_format) -> tuple[Any, Any, dict]:
    """This rank's (train, test) loaders and what the checkpoint records of the data (identity, classes, statistics).
    Another layout (README): files listed otherwise, in list_folder's body; arrays, a branch beside CIFAR-10's here."""
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if cfg.DATASET == "imagefolder" else (CIFAR_MEAN, CIFAR_STD)
    options = {"mean": mean, "std": std, "device": info.device, "memory_format": memory_format}
    kind, how, found = MemoryLoader, "memory", None  # the memory loader's splits: uint8 NHWC images and their labels
    if cfg.DATASET == "imagefolder":
        (classes, train), (_, test) = list_folder(cfg.DATA_DIR, "train"), test_split(cfg)
        cores = len(os.sched_getaffinity(0)) // info.local_world_size  # this rank's share of the machine
        small = sum(os.path.getsize(path) for path, _ in train + test) <= IN_RANK_BYTES
        workers = cfg.NUM_WORKERS if cfg.NUM_WORKERS >= 0 else 0 if small else max(1, cores - 1)
        source = f"files {folder_digest(cfg.DATA_DIR, train + test)}"
        splits: list[Any] = [ImageFiles(s, cfg.IMAGE_SIZE) if s else None for s in (*hold_out(train, cfg), test)]
        with Image.open(train[0][0]) as first:  # the header only: the first line says when images are stretched
            found = "x".join(map(str, first.size))
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / info.local_world_size  # each rank a copy
        gpu = torch.cuda.get_device_properties(info.device).total_memory if info.device.type == "cuda" else room
        if (len(train) + len(test)) * 3 * cfg.IMAGE_SIZE**2 <= MEMORY_SHARE * min(room, gpu):
            splits = [decoded(files, workers, i == 0) if files else None for i, files in enumerate(splits)]
        else:
            kind, how, options = StreamLoader, f"stream, {workers} worker(s) per rank", {**options, "workers": workers}
    elif cfg.DATASET == "synthetic":
        source, n, classes = "generated", cfg.SYNTHETIC_SIZE, [f"class_{c}" for c in range(SYNTHETIC_CLASSES)]
        splits = [make_synthetic(size, cfg.SEED, split, cfg.IMAGE_SIZE) for split, size in enumerate((n, n // 5 or 1))]
    else:
        cifar = [_cifar10(cfg.DATA_DIR, train) for train in (True, False)]
        classes, source = cifar[0].classes, "CIFAR-10"
        splits = [(torch.from_numpy(c.data), torch.tensor(c.targets)) for c in cifar]
    splits = [*hold_out(splits[0], cfg), splits[1]] if len(splits) == 2 else splits  # (an image folder's: done)
    augments = (cfg.AUGMENT, False, False)  # train, val (HOLDOUT's), test: the evaluation splits in the CSV's order
    train, val, test = (kind(s, a, **options) if s is not None else None for s, a in zip(splits, augments, strict=True))
    if len(train) < cfg.BATCH_SIZE:
        raise UserError(f"{len(train)} training images, fewer than BATCH_SIZE={cfg.BATCH_SIZE}; lower it")
    size, evaluated = f"{cfg.IMAGE_SIZE}x{cfg.IMAGE_SIZE}", {"test": test, "val": val}
    counts = [f"{len(part):,} {name}" for name, part in (("train", train), ("held out", val), ("test", test)) if part]
    identity = f"{', '.join(counts)} images of {size}, {len(classes)} classes, {source}"
    identity += f", held out: HOLDOUT={cfg.HOLDOUT} of each class drawn by SEED={cfg.SEED}" if val else ""
    record = {"identity": identity, "classes": classes, "mean": mean, "std": std, "image_size": cfg.IMAGE_SIZE}
    record |= {"loader": how, "train_images": len(train), "stretched": found if found not in (None, size) else None}
    return train, {name: loader for name, loader in evaluated.items() if loader}, record


def make_synthetic(size: int, seed: int, split: int, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable images: each class a smooth colour pattern (crops and flips keep it) under strong noise; uint8 NHWC."""
    patterns = torch.rand(SYNTHETIC_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed * 1_000 + 1 + split)  # train and test: same classes, other images
    labels = torch.randint(SYNTHETIC_CLASSES, (size,), generator=g)
    noise = torch.randn(size, 3, image_size, image_size, generator=g)
    images = (255 * (0.25 + 0.5 * patterns[labels]) + 60 * noise).clamp(0, 255).to(torch.uint8)
    return images.permute(0, 2, 3, 1).contiguous(), labels


def hold_out(split: Any, cfg: SimpleNamespace) -> tuple[Any, Any]:
    """(train, held out or None) of (images, labels) or a (path, label) list: HOLDOUT of each class's images, drawn by
    SEED alone (the same on every rank and every start)."""
    labels = split[1] if isinstance(split, tuple) else torch.tensor([label for _, label in split], dtype=torch.long)
    held, generator = torch.zeros(len(labels), dtype=torch.bool), torch.Generator().manual_seed(cfg.SEED)
    for label in labels.unique().tolist():
        members = (labels == label).nonzero().flatten()
        held[members[torch.randperm(len(members), generator=generator)[: round(cfg.HOLDOUT * len(members))]]] = True
    if not held.any():
        return split, None
    if isinstance(split, tuple):
        return (split[0][~held], labels[~held]), (split[0][held], labels[held])
    return list(compress(split, (~held).tolist())), list(compress(split, held.tolist()))


# ----------------------------------------------------------------------------- image folders
def test_split(cfg: SimpleNamespace) -> tuple[list[str], list[tuple[str, int]]]:
    """test/'s listing; with HOLDOUT none for a folder without test/ (the held-out images are evaluated)."""
    missing = cfg.HOLDOUT and not os.path.exists(os.path.join(cfg.DATA_DIR, "test"))
    return ([], []) if missing else list_folder(cfg.DATA_DIR, "test")


def list_folder(data_dir: str, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-folders, none starting with a dot) and (path, label) of every image below them."""
    root = os.path.join(data_dir, split)
    if not os.path.isdir(root):
        problem = f"has no {split}/ folder" if os.path.isdir(data_dir) else "does not exist"
        other = ", or hold out a share of train/ to evaluate on: --holdout 0.1" if split == "test" else ""
        raise UserError(f"DATA_DIR {data_dir} {problem}; give a folder with train/<class>/ and test/<class>/{other}")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{root} holds no class folders; put one sub-folder per class in it, with the images inside")
    samples = [(path, label) for label, name in enumerate(classes) for path in image_files(os.path.join(root, name))]
    if empty := sorted(set(classes) - {classes[label] for _, label in samples}):
        found = f"Found no valid file for the classes {', '.join(empty)}"
        raise UserError(f"{root}: {found}; every class needs images in train/ and test/")
    if broken := next((path for path, _ in samples if not os.path.exists(path)), None):
        raise UserError(f"{broken} is a link to nothing; remove it or put back what it points to")
    return classes, samples


def image_files(folder: str) -> list[str]:
    """Training's listing, and predict.py's: the files below `folder` (sub-folders, links too) with an image extension
    and no name on the way that starts with a dot (.ipynb_checkpoints, macOS's ._ files), in torchvision's order."""
    found = [os.path.join(top, n) for top, _, names in sorted(os.walk(folder, followlinks=True)) for n in sorted(names)]
    hidden = [f"{os.sep}." in os.sep + os.path.relpath(path, folder) for path in found]
    return [path for path, h in zip(found, hidden, strict=True) if path.lower().endswith(IMAGE_EXTENSIONS) and not h]


def folder_digest(data_dir: str, samples: list[tuple[str, int]]) -> str:
    """An image folder's identity without reading an image: each file's name, class and byte size (docs/data.md)."""
    listing = "".join(f"{os.path.relpath(path, data_dir)} {label} {os.path.getsize(path)}\n" for path, label in samples)
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def decode(path: str, size: int) -> np.ndarray:
    """The image file as size x size x 3 uint8 RGB, stretched to the square (bilinear) if it is not. 16-bit grey keeps
    its levels (Pillow's RGB conversion clips them to white); palette images go through RGBA (their transparency)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning never makes an image unreadable (PYTHONWARNINGS=error)
        with Image.open(path) as image:
            if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 0..65535 -> 0..255
                image = Image.fromarray((np.asarray(image, np.float64).clip(0, 65535) / 257).round().astype(np.uint8))
            image = (image.convert("RGBA") if image.mode in ("P", "PA") else image).convert("RGB")
    return np.array(image if image.size == (size, size) else image.resize((size, size), Image.BILINEAR))  # writable


class ImageFiles(Dataset):
    """A split of an image folder. A file that cannot be decoded becomes a black image marked with its index (left out
    and named), not a worker's traceback. Paths are one numpy array: a list's reference counts copy it page by page."""

    def __init__(self, samples: list[tuple[str, int]], size: int) -> None:
        self.paths = np.array([os.fsencode(path) for path, _ in samples])
        self.labels, self.size = torch.tensor([label for _, label in samples]), size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        try:
            return torch.from_numpy(decode(os.fsdecode(self.paths[index]), self.size)), self.labels[index], -1
        except Exception:  # truncated, not an image, unsupported: named at the end of the pass
            return torch.zeros(self.size, self.size, 3, dtype=torch.uint8), self.labels[index], index

    def unreadable(self, indices: list[int]) -> str:
        names = [os.fsdecode(self.paths[i]) for i in sorted(set(indices))]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"{len(names)} of {len(self):,} images cannot be read: {', '.join(names[:3])}{more}"


def reader(files: ImageFiles, batch_size: int, sampler: Any, workers: int, pin: bool, **options: Any) -> DataLoader:
    """Batches of `files` in `sampler`'s order, decoded a few ahead by `workers` processes kept for the run (0: in this
    process, where a debugger reaches it), from a fork server: a fork of the rank copies the locks its threads hold
    (loader queues, the writer) and can hang on one for good, and would hold the rank's files (OUTPUT_DIR's lock)."""
    parallel: dict[str, Any] = {}
    if workers:
        parallel = {"multiprocessing_context": forkserver_context(), "prefetch_factor": 4, "persistent_workers": True}
        parallel["worker_init_fn"] = partial(quiet_worker, rank=os.getpid())
    return DataLoader(files, batch_size, sampler=sampler, num_workers=workers, pin_memory=pin, **parallel, **options)


def forkserver_context() -> Any:
    """multiprocessing's fork server: a new interpreter (no thread, no file of the run) that imports torch once and
    forks the workers. Started with the stop signals held back, which it and its workers keep: the rank decides."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "data"])
    # A rank ends with os._exit, and a worker it asked for may start after it and open its queues' semaphores: their
    # tracker, which outlives all, frees them, without a warning (-W). First: starting it unblocks SIGINT and SIGTERM.
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    forkserver.ensure_running()  # (if it fails, the rank ends with its line)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return context


def quiet_worker(worker_id: int, rank: int) -> None:
    """A worker leaves stopping to its rank and ends with it (a thread waits on the rank's pidfd; the fork server ends
    after them). A connection the rank dropped (stopped amid a batch's hand-over) is no news."""
    ignore_stop_signals()
    report = sys.excepthook
    sys.excepthook = lambda kind, *rest: None if issubclass(kind, (ConnectionError, EOFError)) else report(kind, *rest)
    if not hasattr(os, "pidfd_open"):  # not Linux: the DataLoader's own look at its parent remains
        return
    try:
        rank_ended = os.pidfd_open(rank)
    except ProcessLookupError:
        os._exit(0)
    threading.Thread(target=lambda: select.select([rank_ended], [], []) and os._exit(0), daemon=True).start()


def decoded(files: ImageFiles, workers: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The split decoded once by `workers` processes (on every rank), uint8 NHWC, less the files unreadable now."""
    pixels, labels, marks = (torch.cat(p) for p in zip(*reader(files, EVAL_BATCH, None, workers, False), strict=True))
    keep = readable_enough(files, marks[marks >= 0].tolist(), "left out of the run" if training else None)  # DDP: all
    return pixels[keep], labels[keep]


def readable_enough(files: ImageFiles, bad: list[int], left_out: str | None) -> torch.Tensor:
    """True for each file every rank read in a pass; rank 0 names the rest (over a tenth, or a class, stops all)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)  # DDP: every rank, at the end of each pass
    found = sorted({i for theirs in everyone for i in theirs})
    readable = torch.isin(torch.arange(len(files)), torch.tensor(found, dtype=torch.long), invert=True)
    if found:
        line = files.unreadable(found)
        if emptied := set(files.labels.tolist()) - set(files.labels[readable].tolist()):  # as a class with no images
            folder = os.path.dirname(os.fsdecode(files.paths[(files.labels == min(emptied)).numpy()][0]))
            raise UserError(f"no image in {folder} can be read ({line}); put back good copies and resume; {KEPT}")
        if len(found) > UNREADABLE_STOP * len(files):
            raise UserError(f"{line}; put back good copies and resume; {KEPT}")
        what = left_out or f"the accuracy is over the other {len(files) - len(found):,}"
        print(f"warning: {line}; {what}", file=sys.stderr, flush=True) if dist.get_rank() == 0 else None
    return readable


# ----------------------------------------------------------------------------- the loaders
class Loader:
    """What both loaders do on the device: crops and flips for training, normalisation, the model's memory format."""

    def __init__(self, augment: bool, mean: tuple, std: tuple, device: torch.device, memory_format: Any) -> None:
        self.augment, self.device, self.memory_format = augment, device, memory_format
        self.mean, self.std = (torch.tensor(m, device=device).view(1, 3, 1, 1) * 255 for m in (mean, std))

    def __len__(self) -> int:
        return len(self.labels)  # the split's images

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def prepare(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW in the model's memory format; with `generator`, cropped and flipped."""
        if generator is not None and self.augment:
            pixels = crop_and_flip(pixels, max(1, round(pixels.shape[1] / 8)), generator)  # 4 pixels at 32x32
        x = (pixels.permute(0, 3, 1, 2) - self.mean) / self.std  # uint8 - float: float, in one launch
        return x.contiguous(memory_format=self.memory_format)

    def augmentation(self, seed: int, epoch: int, rank: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed_for(seed, epoch, rank))  # differs per rank


class MemoryLoader(Loader):
    """A split held on the device: per-epoch shards, batches by indexing."""

    def __init__(self, split: tuple[torch.Tensor, torch.Tensor], *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.pixels, self.labels = (tensor.to(self.device) for tensor in split)  # (images, labels)

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Any:
        local_batch, generator = global_batch // world_size, self.augmentation(seed, epoch, rank)
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)  # this rank's shard
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch : (step + 1) * local_batch]
            yield self.prepare(self.pixels[batch], generator), self.labels[batch]

    def eval_batches(self, world_size: int, rank: int) -> Any:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        part = torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank]
        for batch in part.split(EVAL_BATCH):
            yield self.prepare(self.pixels[batch]), self.labels[batch]


class StreamLoader(Loader):
    """A split of an image folder read as training goes by DataLoader workers; unreadable files: readable_enough()."""

    def __init__(self, files: ImageFiles, *args: Any, workers: int, **options: Any) -> None:
        super().__init__(*args, **options)
        self.files, self.labels, self.readers = files, files.labels, {}
        self.reader = partial(reader, files, workers=workers, pin=self.device.type == "cuda")  # pinned: copied async

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Any:
        if "train" not in self.readers:  # each rank's shard of one shuffle; drop_last: every rank as many steps
            sampler = DistributedSampler(self.files, world_size, rank, shuffle=True, seed=seed, drop_last=True)
            self.readers["train"] = self.reader(global_batch // world_size, sampler, drop_last=True)
        self.readers["train"].sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        yield from self._batches(self.readers["train"], self.augmentation(seed, epoch, rank))

    def eval_batches(self, world_size: int, rank: int) -> Any:
        if "test" not in self.readers:  # no image padded in or left out
            part = torch.tensor_split(torch.arange(len(self)), world_size)[rank].tolist()
            self.readers["test"] = self.reader(EVAL_BATCH // 2, part)
        yield from self._batches(self.readers["test"], None)

    def _batches(self, batches: DataLoader, generator: torch.Generator | None) -> Any:
        bad: list[int] = []
        for pixels, labels, marks in batches:
            if (marks >= 0).any():  # on the host, from the workers: no device sync
                bad += marks[marks >= 0].tolist()
                if (marks >= 0).all():  # nothing of the batch to train on: the data is gone
                    raise UserError(f"{self.files.unreadable(bad)}; put back good copies and resume; {KEPT}")
                pixels, labels = pixels[marks < 0], labels[marks < 0]  # the files that cannot be read are left out
            pixels, labels = (part.to(self.device, non_blocking=True) for part in (pixels, labels))
            yield self.prepare(pixels, generator), labels
        readable_enough(self.files, bad, "left out of this pass" if generator else None)  # DDP: every rank


def seed_for(*parts: int) -> int:
    """One 63-bit seed from several integers (SEED, epoch, rank): each one a digit of a number in base 1,000,003."""
    return reduce(lambda value, part: (value * 1_000_003 + part + 1) % 2**63, parts, 0)


def shard_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's shard of the epoch: all ranks draw one permutation (from seed and epoch), each takes every
    world_size-th entry (the last n % world_size sit out): step s uses the same global batch at any world size."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))  # StreamLoader's sampler's
    return permutation[rank : n - n % world_size : world_size]


def crop_and_flip(pixels: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops of reflect-padded images (shifts up to `pad`) and flips, per image, in one gather; uint8 BHWC."""
    batch, height, width, _ = pixels.shape
    shifts = torch.randint(-pad, pad + 1, (2, batch), generator=generator, device=pixels.device)
    rows, cols = reflected(height, pad, pixels.device)[shifts[0]], reflected(width, pad, pixels.device)[shifts[1]]
    flip = torch.rand(batch, 1, generator=generator, device=pixels.device) < 0.5
    cols = torch.where(flip, width - 1 - cols, cols)
    return pixels[torch.arange(batch, device=pixels.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


@cache
def reflected(size: int, pad: int, device: torch.device) -> torch.Tensor:
    """Row s (-pad..pad, negative s from the end): a reflect-padded image's rows (or columns) shifted by s."""
    index = (torch.arange(size) + torch.arange(-pad, pad + 1).roll(-pad)[:, None]).abs()  # mirrored at 0 ...
    return (size - 1 - (size - 1 - index).abs()).to(device)  # ... and at size - 1
