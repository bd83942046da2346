"""Datasets as uint8 tensors, and a loader that shards, augments and batches them on the device.

Every dataset becomes two `ImageSet`s (train, test) of IMAGE_SIZE x IMAGE_SIZE uint8 images, read once. An
image folder is decoded once per machine (every image checked, resized to the square if it is not) into a cache
file that later runs and the other ranks load in a fraction of a second, with its channel statistics.
`DeviceLoader` keeps a set on the training device and per epoch gives this rank its shard of one shared
permutation, cut into batches by indexing, cropped, flipped and normalised there: no per-image Python work.
"""

import os
import pickle
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import image_folder
import outputs
from distribute_tools import DistInfo, all_ranks_try, under_torchrun
from processes import UserError, first_line

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's published, 0..1 units
Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (images, labels) on the device
SYNTHETIC_CLASSES = 10
CIFAR_ARCHIVE, CIFAR_SIZES = "cifar-10-python.tar.gz", (50_000, 10_000, 10)  # train images, test images, classes


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, (N, 3, size, size)
    labels: torch.Tensor  # int64, (N,)
    classes: list[str]
    mean: tuple[float, ...] = CIFAR_MEAN  # per-channel statistics the loader normalises with, 0..1 units
    std: tuple[float, ...] = CIFAR_STD
    resized: int = 0  # images that had another size and were resized to the square

    def __len__(self) -> int:
        return len(self.labels)

    def checksum(self) -> int:
        """Cheap, order-sensitive: ranks compare it to find a machine with another copy of the data."""
        position = torch.arange(1, len(self) + 1, dtype=torch.int64)
        # Each image's bytes read as int64 words and summed (wrapping): 40x faster than widening every pixel.
        per_image = self.images.contiguous().view(len(self), -1).view(torch.int64).sum(dim=1)
        return int(((per_image + 7919 * self.labels) * position).sum())


def identity(train: ImageSet, test: ImageSet) -> str:
    """What tells one data set from another: a resume on other data is refused with it."""
    size, checksum = train.images.shape[-1], train.checksum() ^ test.checksum()
    return f"{len(train):,} train and {len(test):,} test images of {size}x{size}, checksum {checksum:x}"


def record(train: ImageSet, test: ImageSet) -> dict[str, Any]:
    """What a checkpoint records of the data: its identity, and what an evaluation of the weights needs."""
    return {
        "identity": identity(train, test),
        "classes": train.classes,
        "mean": train.mean,
        "std": train.std,
        "image_size": train.images.shape[-1],
        "resized": train.resized + test.resized,
    }


# ----------------------------------------------------------------------------- before training


def sizes(cfg: SimpleNamespace) -> tuple[int, int, int]:
    """Training images, test images and classes, without reading any image."""
    if cfg.DATASET == "synthetic":
        return cfg.SYNTHETIC_SIZE, max(cfg.SYNTHETIC_SIZE // 5, 1), SYNTHETIC_CLASSES
    if cfg.DATASET == "cifar10":
        if cfg.IMAGE_SIZE != 32:
            raise UserError(f"IMAGE_SIZE={cfg.IMAGE_SIZE} but CIFAR-10's images are 32x32; use --image_size 32")
        return CIFAR_SIZES
    (classes, train), (test_classes, test) = (
        image_folder.list_images(os.path.join(cfg.DATA_DIR, s)) for s in ("train", "test")
    )
    image_folder.check_same_classes(cfg.DATA_DIR, classes, test_classes)
    return len(train), len(test), len(classes)


def prepare(cfg: SimpleNamespace) -> None:
    """What one process per machine does before any rank loads the data: download CIFAR-10, or decode and
    check an image folder into its cache. Raises UserError naming the file or folder at fault."""
    if cfg.DATASET == "cifar10":
        download_cifar10(cfg.DATA_DIR)
    elif cfg.DATASET == "imagefolder":
        for split in ("train", "test"):  # sizes() has checked the folders and their classes
            image_folder.ensure_decoded(os.path.join(cfg.DATA_DIR, split), cfg.IMAGE_SIZE)


def check_sizes(cfg: SimpleNamespace, make_model: Callable[[int], torch.nn.Module], ranks: int) -> None:
    """Before anything starts: at least one global batch of training images, and data and model that fit in
    this machine's memory. Per rank: the uint8 set and its copy on the device (generated images pass through
    float32 noise first), the weights with their gradients, momentum and the two copies a checkpoint makes."""
    train_images, test_images, classes = sizes(cfg)
    if train_images < cfg.BATCH_SIZE:
        raise UserError(
            f"the training set has {train_images} images, fewer than one global batch (BATCH_SIZE={cfg.BATCH_SIZE}); "
            f"lower --batch_size"
        )
    parameters = count_parameters(make_model, classes)
    data_bytes = (train_images + test_images) * 3 * cfg.IMAGE_SIZE**2 * (10 if cfg.DATASET == "synthetic" else 2)
    needed, here = ranks * (data_bytes + 20 * parameters), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > here:
        raise UserError(
            f"this run needs about {needed / 2**30:,.0f} GB of memory ({ranks} rank(s) x {data_bytes / 2**30:,.1f} GB "
            f"of images and {20 * parameters / 2**30:,.1f} GB for {parameters:,} parameters), more than this "
            f"machine's {here / 2**30:,.0f} GB; lower --image_size, the number of images or the network's size"
        )


def count_parameters(make_model: Callable[[int], torch.nn.Module], classes: int) -> int:
    """On the meta device, which allocates nothing, or on the CPU where the constructor computes with its tensors
    (`.item()`, as timm's models do). A network that cannot be built is one line naming where it failed."""
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                return sum(p.numel() for p in make_model(classes).parameters())
        except Exception as e:
            error, where = e, traceback.extract_tb(e.__traceback__)[-1]
    raise UserError(
        f"make_model cannot build the network ({type(error).__name__}: {first_line(error)}, at "
        f"{os.path.basename(where.filename)}:{where.lineno}); fix make_model or the network's settings"
    )


def download_cifar10(data_dir: str, timeout_s: float = 60.0) -> None:
    """Fetch and unpack CIFAR-10 into data_dir unless it is there already (torchvision checks md5 sums).
    One process at a time per folder (a file lock): ranks downloading at once corrupt the archive."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise UserError(f"DATA_DIR {data_dir} is a file; point --data_dir at a folder (CIFAR-10 is downloaded there)")
    archive, previous = os.path.join(data_dir, CIFAR_ARCHIVE), socket.getdefaulttimeout()
    os.makedirs(data_dir, exist_ok=True)
    socket.setdefaulttimeout(timeout_s)  # torchvision's download sets no timeout of its own
    try:
        with outputs.lock_file(os.path.join(data_dir, ".cifar10.lock")):
            if os.path.exists(archive) and not check_integrity(archive, CIFAR10.tgz_md5):
                raise UserError(
                    f"{archive} is corrupt (its checksum is wrong); delete it and rerun to download it again, "
                    f"or copy a good copy there"
                )
            CIFAR10(data_dir, train=True, download=True)
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"could not download CIFAR-10 into {data_dir} ({first_line(e)}); on an offline machine copy "
            f"{CIFAR_ARCHIVE} into {data_dir}/ by hand and rerun, or use --dataset imagefolder"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)


# ----------------------------------------------------------------------------- readers


def load(cfg: SimpleNamespace, dist_info: DistInfo) -> tuple[ImageSet, ImageSet]:
    """This rank's (train, test) sets on the CPU. Under torchrun, where no launcher prepared the data, local
    rank 0 of each machine prepares it first. Every rank must hold the same images (a machine with another
    copy of DATA_DIR would hang or train on other data): their identities meet once."""
    if under_torchrun():
        all_ranks_try(lambda: prepare(cfg) if dist_info.local_rank == 0 else None)
    train, test = read(cfg)
    everyone: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(everyone, identity(train, test))
    others = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if others:
        raise UserError(
            f"rank(s) {', '.join(map(str, others))} loaded other data than rank 0 ({everyone[others[0]]}, against "
            f"{everyone[0]}); give every machine the same copy of DATA_DIR"
        )
    return train, test


def read(cfg: SimpleNamespace) -> tuple[ImageSet, ImageSet]:
    """(train, test) of DATASET, prepared before; the test set is normalised with the training set's statistics."""
    if cfg.DATASET == "cifar10":
        return read_cifar10(cfg.DATA_DIR, train=True), read_cifar10(cfg.DATA_DIR, train=False)
    if cfg.DATASET == "imagefolder":
        train, test = (
            ImageSet(**image_folder.decoded(os.path.join(cfg.DATA_DIR, s), cfg.IMAGE_SIZE)) for s in ("train", "test")
        )
        test.mean, test.std = train.mean, train.std
        return train, test
    train = make_synthetic(cfg.SYNTHETIC_SIZE, cfg.SEED, split=0, image_size=cfg.IMAGE_SIZE)
    test = make_synthetic(max(cfg.SYNTHETIC_SIZE // 5, 1), cfg.SEED, split=1, image_size=cfg.IMAGE_SIZE, like=train)
    return train, test


def read_cifar10(data_dir: str, train: bool) -> ImageSet:
    """CIFAR-10's python batches, read directly (torchvision, seconds to import in every rank, is only needed
    to download them)."""
    folder = os.path.join(data_dir, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    try:
        batches = []
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                batches.append(pickle.load(f, encoding="latin1"))
        with open(os.path.join(folder, "batches.meta"), "rb") as f:
            classes = pickle.load(f, encoding="latin1")["label_names"]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError):
        raise UserError(
            f"CIFAR-10 is missing or corrupt in {data_dir}; delete it there and rerun to download it again, or "
            f"copy {CIFAR_ARCHIVE} into {data_dir}/ by hand"
        ) from None
    pixels = torch.cat([torch.as_tensor(batch["data"]) for batch in batches]).view(-1, 3, 32, 32)
    labels = torch.tensor([label for batch in batches for label in batch["labels"]], dtype=torch.int64)
    return ImageSet(pixels.contiguous(), labels, list(classes))


def make_synthetic(size: int, seed: int, split: int, image_size: int = 32, like: ImageSet | None = None) -> ImageSet:
    """Images that a network can learn: each class has its own smooth colour pattern (smooth, so that crops and
    flips keep it recognisable), and every image adds strong noise. `like`: the training set, whose statistics
    the test set is normalised with."""
    patterns = torch.rand(SYNTHETIC_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=image_size, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed * 1_000 + 1 + split)  # train and test: same classes, other images
    labels = torch.randint(SYNTHETIC_CLASSES, (size,), generator=g)
    noise = torch.randn(size, 3, image_size, image_size, generator=g)
    images = (255 * (0.25 + 0.5 * patterns[labels]) + 60 * noise).clamp(0, 255).to(torch.uint8)
    mean, std = (like.mean, like.std) if like else image_folder.channel_statistics(images)
    return ImageSet(images, labels, [f"class_{c}" for c in range(SYNTHETIC_CLASSES)], mean, std)


# ----------------------------------------------------------------------------- sharding and augmentation


def seed_for(*parts: int) -> int:
    """One 63-bit seed from several integers (SEED, epoch, rank, ...)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**63)
    return value


def shard_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's shard of the epoch: every rank draws the same permutation (from seed and epoch) and takes
    every world_size-th entry of it. The shards are disjoint and equal-sized; the last n % world_size entries
    of the permutation sit out this epoch. Striding (not slicing) makes step s of every rank together use
    permutation[s*B:(s+1)*B]: the same global batches at any world size."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed_for(seed, epoch)))
    return permutation[rank : n - n % world_size : world_size]


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices that fall off either edge mirror back into 0..size-1 (reflect padding)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def crop_and_flip(pixels: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops of a reflect-padded image (shifts of up to `pad` pixels) and random horizontal flips, drawn
    per image, done with one gather. pixels: uint8 (B, H, W, C); returns the same shape."""
    batch, height, width, _ = pixels.shape
    device = pixels.device
    shifts = torch.randint(-pad, pad + 1, (2, batch, 1), generator=generator, device=device)
    rows = _reflect(torch.arange(height, device=device) + shifts[0], height)
    cols = _reflect(torch.arange(width, device=device) + shifts[1], width)
    flip = torch.rand(batch, 1, generator=generator, device=device) < 0.5
    cols = torch.where(flip, width - 1 - cols, cols)
    return pixels[torch.arange(batch, device=device)[:, None, None], rows[:, :, None], cols[:, None, :]]


class DeviceLoader:
    """One split on the training device: per-epoch shards, batches by indexing, augmentation and normalisation
    on the device. Batches come out as float32 in `memory_format`."""

    def __init__(
        self,
        data: ImageSet,
        device: torch.device,
        augment: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> None:
        self.pixels = data.images.permute(0, 2, 3, 1).contiguous().to(device)  # NHWC: a batch is one gather
        self.labels = data.labels.to(device)
        self.device, self.augment, self.memory_format = device, augment, memory_format
        self.crop_pad = max(1, round(data.images.shape[-1] / 8))  # 4 pixels at 32x32, 8 at 64x64
        self.mean = torch.tensor(data.mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(data.std, device=device).view(1, 3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.labels)

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Batches:
        local_batch = global_batch // world_size
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed_for(seed, epoch, rank))  # augmentation differs per rank
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch : (step + 1) * local_batch]
            pixels = self.pixels[batch]
            if self.augment:
                pixels = crop_and_flip(pixels, self.crop_pad, generator)
            yield self.normalise(pixels), self.labels[batch]

    def eval_batches(self, world_size: int, rank: int, batch_size: int = 1000) -> Batches:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        part = torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank]
        for batch in part.split(batch_size):
            yield self.normalise(self.pixels[batch]), self.labels[batch]

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW in the model's memory format."""
        x = (pixels.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return x.contiguous(memory_format=self.memory_format)
