"""The data: CIFAR-10, your image folder or generated images, as each rank's batches, cropped, flipped and normalised
on the device. Two loaders with one interface:

    MemoryLoader  the whole split on the device as uint8: per epoch this rank's shard of one permutation that every
                  rank draws alike, batches cut by indexing (no per-image Python work: the fast path)
    StreamLoader  torch's DataLoader with a DistributedSampler: worker processes decode the files as training goes

LOADER="auto" holds CIFAR-10 and generated images in memory and streams image folders, which may be of any size;
"memory" decodes an image folder once as the run starts.
"""

import hashlib
import os
import socket
import warnings
from contextlib import nullcontext
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
from safeguards.failures import KEPT, UserError, first_line, guard_parent, ignore_stop_signals

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's published, 0..1 units
SYNTHETIC_CLASSES = 10
STATISTICS_SAMPLE = 2_000  # an image folder's normalisation comes from this many training images, drawn with seed 0
EVAL_BATCH = 500  # test images per evaluation batch


def sizes(cfg: SimpleNamespace) -> tuple[int, int]:
    """Training images and classes, without decoding an image: what the checks before the start need."""
    if cfg.DATASET != "imagefolder":
        return (cfg.SYNTHETIC_SIZE, SYNTHETIC_CLASSES) if cfg.DATASET == "synthetic" else (50_000, 10)
    classes, samples = list_folder(cfg.DATA_DIR, "train")
    return len(samples), len(classes)


def prepare(cfg: SimpleNamespace) -> None:
    """Download CIFAR-10 into DATA_DIR unless it is there: one process per folder at a time (a file lock), since ranks
    downloading at once corrupt the archive. An image folder: both splits must hold the same classes."""
    if cfg.DATASET == "imagefolder" and list_folder(cfg.DATA_DIR, "train")[0] != list_folder(cfg.DATA_DIR, "test")[0]:
        raise UserError(
            f"{cfg.DATA_DIR}/train and {cfg.DATA_DIR}/test hold different class folders; every class needs images in "
            f"both: add the missing class folders, or move the class out of both"
        )
    if cfg.DATASET != "cifar10":
        return
    try:
        os.makedirs(cfg.DATA_DIR, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"DATA_DIR {cfg.DATA_DIR} cannot be created ({e.strerror}); point --data_dir elsewhere"
        ) from None
    writable, previous = os.access(cfg.DATA_DIR, os.W_OK), socket.getdefaulttimeout()  # read-only: no lock, none needed
    socket.setdefaulttimeout(60)  # torchvision's download sets no timeout of its own
    try:
        with filelock.FileLock(os.path.join(cfg.DATA_DIR, ".cifar10.lock")) if writable else nullcontext():
            _cifar10(cfg.DATA_DIR, train=True, download=True)
    finally:
        socket.setdefaulttimeout(previous)


def _cifar10(data_dir: str, train: bool, download: bool = False) -> Any:
    from torchvision.datasets import CIFAR10  # here: torchvision takes seconds to import, and only CIFAR-10 needs it

    try:
        return CIFAR10(data_dir, train=train)
    except RuntimeError:  # not there, or corrupt
        if not download:
            raise UserError(f"CIFAR-10 is missing or corrupt in {data_dir}; delete it there and rerun") from None
    try:
        return CIFAR10(data_dir, train=train, download=True)
    except Exception as e:
        raise UserError(
            f"could not download CIFAR-10 into {data_dir} ({first_line(e)}); offline, copy cifar-10-python.tar.gz "
            f"into {data_dir}/ by hand and rerun, or use --dataset imagefolder"
        ) from None


def load(cfg: SimpleNamespace, info: DistInfo, memory_format: torch.memory_format) -> tuple[Any, Any, dict]:
    """This rank's (train, test) loaders and what the checkpoint records of the data. Every rank must hold the same
    data (a machine with another copy of DATA_DIR would train on other data or hang): their identities meet once."""
    streams = cfg.LOADER == "stream" or (cfg.LOADER == "auto" and cfg.DATASET == "imagefolder")
    workers = (
        cfg.NUM_WORKERS if cfg.NUM_WORKERS >= 0 else max(1, len(os.sched_getaffinity(0)) // info.local_world_size - 1)
    )
    if cfg.DATASET == "imagefolder":
        (classes, train), (_, test) = list_folder(cfg.DATA_DIR, "train"), list_folder(cfg.DATA_DIR, "test")
        splits: list[Any] = [ImageFiles(samples, cfg.IMAGE_SIZE) for samples in (train, test)]
        sample = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:STATISTICS_SAMPLE].sort()[0]
        mean, std = channel_statistics(decode_all(splits[0], workers, sample.tolist())[0])
        source = f"files {folder_digest(cfg.DATA_DIR, train + test)}"
        splits = splits if streams else [decode_all(files, workers, range(len(files))) for files in splits]
    else:
        *splits, classes = read_in_memory(cfg)
        mean, std = channel_statistics(splits[0][0]) if cfg.DATASET == "synthetic" else (CIFAR_MEAN, CIFAR_STD)
        source = "generated" if cfg.DATASET == "synthetic" else "CIFAR-10"
    options = {"mean": mean, "std": std, "device": info.device, "memory_format": memory_format}
    kind, options = (StreamLoader, {**options, "workers": workers}) if streams else (MemoryLoader, options)
    loaders = [kind(split, augment, **options) for split, augment in zip(splits, (cfg.AUGMENT, False), strict=True)]
    size = f"{cfg.IMAGE_SIZE}x{cfg.IMAGE_SIZE}"
    identity = (
        f"{len(loaders[0]):,} train and {len(loaders[1]):,} test images of {size}, {len(classes)} classes, {source}"
    )
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, identity)  # DDP: every rank's data, compared once
    if others := [str(rank) for rank, theirs in enumerate(everyone) if theirs != identity]:
        raise UserError(
            f"rank(s) {', '.join(others)} loaded other data than rank {info.rank} ({identity}); give every machine the "
            f"same copy of DATA_DIR"
        )
    how = f"stream, {workers} worker(s) per rank" if streams else "memory"
    record = {"identity": identity, "classes": classes, "mean": mean, "std": std, "image_size": cfg.IMAGE_SIZE}
    return loaders[0], loaders[1], {**record, "loader": how}


def read_in_memory(cfg: SimpleNamespace) -> tuple[tuple, tuple, list[str]]:
    """CIFAR-10 or generated images: (train images, labels), (test images, labels), the class names; uint8 NHWC."""
    if cfg.DATASET == "synthetic":
        sizes_ = (cfg.SYNTHETIC_SIZE, max(cfg.SYNTHETIC_SIZE // 5, 1))
        train, test = (make_synthetic(n, cfg.SEED, split, cfg.IMAGE_SIZE) for split, n in enumerate(sizes_))
        return train, test, [f"class_{c}" for c in range(SYNTHETIC_CLASSES)]
    train, test = (_cifar10(cfg.DATA_DIR, split) for split in (True, False))
    pixels = [(torch.from_numpy(split.data), torch.tensor(split.targets)) for split in (train, test)]
    return pixels[0], pixels[1], train.classes


def make_synthetic(size: int, seed: int, split: int, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Images that a network can learn: each class has its own smooth colour pattern (smooth, so that crops and flips
    keep it recognisable), and every image adds strong noise. uint8 NHWC images and their labels."""
    patterns = torch.rand(SYNTHETIC_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed * 1_000 + 1 + split)  # train and test: same classes, other images
    labels = torch.randint(SYNTHETIC_CLASSES, (size,), generator=g)
    noise = torch.randn(size, 3, image_size, image_size, generator=g)
    images = (255 * (0.25 + 0.5 * patterns[labels]) + 60 * noise).clamp(0, 255).to(torch.uint8)
    return images.permute(0, 2, 3, 1).contiguous(), labels


# ----------------------------------------------------------------------------- image folders


def list_folder(data_dir: str, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-folder names; hidden ones such as .ipynb_checkpoints skipped) and (path, label) of every
    image in them, in sub-folders too (torchvision's listing)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    root = os.path.join(data_dir, split)
    if not os.path.isdir(root):
        problem = f"has no {split}/ folder" if os.path.isdir(data_dir) else "does not exist"
        raise UserError(
            f"DATA_DIR {data_dir} {problem}; point --data_dir at a folder with train/<class>/<image> and test/"
        )
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{root} holds no class folders; put one sub-folder per class in it, with the images inside")
    try:
        return classes, make_dataset(root, {name: label for label, name in enumerate(classes)}, IMG_EXTENSIONS)
    except FileNotFoundError as e:  # a class without images
        raise UserError(f"{root}: {first_line(e).rstrip('.')}; every class needs images in train/ and test/") from None


def folder_digest(data_dir: str, samples: list[tuple[str, int]]) -> str:
    """An image folder's identity without reading an image: every file's name, class and byte size (not its time:
    copies on other machines must agree). A file replaced by another of the same name and size is not noticed."""
    digest = hashlib.sha256()
    for path, label in samples:
        digest.update(f"{os.path.relpath(path, data_dir)} {label} {os.path.getsize(path)}\n".encode())
    return digest.hexdigest()[:16]


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
    """A split of an image folder, read from its files. A file that cannot be decoded becomes a black image marked
    with its index, so that the ranks stop together (StreamLoader) instead of one worker's traceback stopping one
    rank. Paths are one numpy array, which forked workers share (a list's reference counts would copy it)."""

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
    """Batches of `files` in the order of `sampler`, decoded by `workers` forked processes a few batches ahead (each
    leaves stopping to its rank and dies with it); workers=0 decodes in this process, where a debugger reaches it."""
    parallel = (
        {"multiprocessing_context": "fork", "prefetch_factor": 4, "worker_init_fn": quiet_worker} if workers else {}
    )
    return DataLoader(files, batch_size, sampler=sampler, num_workers=workers, pin_memory=pin, **parallel, **options)


def quiet_worker(worker_id: int) -> None:
    ignore_stop_signals()  # a Ctrl-C or scancel reaches every process: the rank decides what happens
    guard_parent(None)


def decode_all(files: ImageFiles, workers: int, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The images at `indices`, uint8 NHWC, and their labels; an unreadable one is one line on every rank alike."""
    batches = list(reader(files, 256, list(indices), workers, pin=False))
    if bad := [i for _, _, marks in batches for i in marks.tolist() if i >= 0]:
        raise UserError(f"{files.unreadable(bad)}; delete or replace them and rerun")
    return torch.cat([pixels for pixels, _, _ in batches]), torch.cat([labels for _, labels, _ in batches])


def channel_statistics(pixels: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 NHWC images, in 0..1 units (summed in chunks, in float64)."""
    chunks = (chunk.reshape(-1, 3).double() / 255 for chunk in pixels.split(1024))
    mean, squares = sum(torch.stack([x.sum(0), (x * x).sum(0)]) for x in chunks) / (pixels.numel() // 3)
    return tuple(mean.tolist()), tuple((squares - mean**2).clamp(min=1e-12).sqrt().tolist())


# ----------------------------------------------------------------------------- the loaders


class Loader:
    """What both loaders do on the device: crops and flips for training, normalisation, the model's memory format."""

    def __init__(self, augment: bool, mean: tuple, std: tuple, device: torch.device, memory_format: Any) -> None:
        self.augment, self.device, self.memory_format = augment, device, memory_format
        self.mean, self.std = (torch.tensor(m, device=device).view(1, 3, 1, 1) * 255 for m in (mean, std))

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def prepare(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW in the model's memory format; with `generator`, cropped and flipped."""
        if generator is not None and self.augment:
            pixels = crop_and_flip(pixels, max(1, round(pixels.shape[1] / 8)), generator)  # 4 pixels at 32x32
        return ((pixels.permute(0, 3, 1, 2).float() - self.mean) / self.std).contiguous(
            memory_format=self.memory_format
        )

    def augmentation(self, seed: int, epoch: int, rank: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed_for(seed, epoch, rank))  # differs per rank


class MemoryLoader(Loader):
    """A split held on the device: per-epoch shards, batches by indexing."""

    def __init__(self, split: tuple[torch.Tensor, torch.Tensor], *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.pixels, self.labels = (tensor.to(self.device) for tensor in split)  # (images, labels)

    def __len__(self) -> int:
        return len(self.labels)

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Any:
        local_batch, generator = global_batch // world_size, self.augmentation(seed, epoch, rank)
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)  # DDP: this rank's shard
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch : (step + 1) * local_batch]
            yield self.prepare(self.pixels[batch], generator), self.labels[batch]

    def eval_batches(self, world_size: int, rank: int) -> Any:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        for batch in torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank].split(
            EVAL_BATCH
        ):
            yield self.prepare(self.pixels[batch]), self.labels[batch]


class StreamLoader(Loader):
    """A split of an image folder, read from its files as training goes by DataLoader workers (kept across epochs
    for training, started per pass for evaluation). A file that cannot be decoded stops every rank at the end of the
    pass, in one line naming it."""

    def __init__(self, files: ImageFiles, *args: Any, workers: int, **options: Any) -> None:
        super().__init__(*args, **options)
        self.files, self.workers, self.readers = files, workers, {}

    def __len__(self) -> int:
        return len(self.files)

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Any:
        if "train" not in self.readers:  # DDP: each rank's shard of one shuffle; drop_last: every rank as many steps
            sampler = DistributedSampler(self.files, world_size, rank, shuffle=True, seed=seed, drop_last=True)
            persistent = {"persistent_workers": True} if self.workers else {}
            self.readers["train"] = self.reader(global_batch // world_size, sampler, drop_last=True, **persistent)
        self.readers["train"].sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same on every rank
        yield from self._batches(self.readers["train"], self.augmentation(seed, epoch, rank))

    def eval_batches(self, world_size: int, rank: int) -> Any:
        part = torch.tensor_split(torch.arange(len(self)), world_size)[rank].tolist()  # no image padded in or left out
        yield from self._batches(self.reader(EVAL_BATCH // 2, part), None)

    def reader(self, batch_size: int, sampler: Any, **options: Any) -> DataLoader:
        return reader(self.files, batch_size, sampler, self.workers, self.device.type == "cuda", **options)

    def _batches(self, batches: DataLoader, generator: torch.Generator | None) -> Any:
        bad: list[int] = []
        for pixels, labels, marks in batches:
            bad += marks[marks >= 0].tolist()  # on the host, from the workers: no device sync
            yield self.prepare(pixels.to(self.device, non_blocking=True), generator), labels.to(self.device)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)  # DDP: every rank, at the end of each pass
        if found := [i for theirs in everyone for i in theirs]:
            raise UserError(f"{self.files.unreadable(found)}; put back good copies and resume; {KEPT}")


def seed_for(*parts: int) -> int:
    """One 63-bit seed from several integers (SEED, epoch, rank)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**63)
    return value


def shard_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's shard of the epoch: every rank draws the same permutation (from seed and epoch) and takes every
    world_size-th entry, so that step s of all ranks together uses the same global batch at any world size. The
    last n % world_size entries of the permutation sit out the epoch."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed_for(seed, epoch)))
    return permutation[rank : n - n % world_size : world_size]


def crop_and_flip(pixels: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops of a reflect-padded image (shifts of up to `pad` pixels) and random horizontal flips, drawn per
    image, done with one gather. uint8 (B, H, W, C) in and out."""
    batch, height, width, _ = pixels.shape
    shifts = torch.randint(-pad, pad + 1, (2, batch, 1), generator=generator, device=pixels.device)
    rows = _reflect(torch.arange(height, device=pixels.device) + shifts[0], height)
    cols = _reflect(torch.arange(width, device=pixels.device) + shifts[1], width)
    flip = torch.rand(batch, 1, generator=generator, device=pixels.device) < 0.5
    cols = torch.where(flip, width - 1 - cols, cols)
    return pixels[torch.arange(batch, device=pixels.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices that fall off either edge mirror back into 0..size-1 (reflect padding)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)
