"""Datasets as uint8 tensors, and a loader that shards, augments and batches them on the device.

Every dataset becomes two `ImageSet`s (train, test) of uint8 images, read once. `DeviceLoader`
keeps a set on the training device and per epoch gives this rank its shard of one shared
permutation, cut into batches by indexing, cropped, flipped and normalised on the device:
no per-image Python work while training.
"""
import os
import socket
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.datasets import CIFAR10, ImageFolder
from torchvision.transforms.functional import pil_to_tensor

from distribute_tools import UserError

DATASETS = ("cifar10", "imagefolder", "synthetic")
IMAGE_SIZE = 32
CROP_PAD = 4  # random crops shift images by up to this many pixels (reflect padding)
# CIFAR-10's per-channel mean and standard deviation, in 0..1 pixel units.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, (N, 3, 32, 32)
    labels: torch.Tensor  # int64, (N,)
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)


# ----------------------------------------------------------------------------- checks and download


def count_training_images(dataset: str, data_dir: str, synthetic_size: int) -> int:
    """Cheap checks of the data that a launcher can make before starting any process.
    Returns the number of training images; raises UserError for a folder that cannot work."""
    if dataset == "synthetic":
        return synthetic_size
    if dataset == "cifar10":
        return 50_000
    if not os.path.isdir(data_dir):
        raise UserError(f"DATA_DIR {data_dir} does not exist; point --data_dir at a folder with train/ and test/ inside")
    counts = {}
    for split in ("train", "test"):
        root = os.path.join(data_dir, split)
        if not os.path.isdir(root):
            raise UserError(f"DATA_DIR {data_dir} has no {split}/ folder; DATASET=imagefolder reads "
                            f"{data_dir}/train/<class>/<image> and {data_dir}/test/<class>/<image>")
        counts[split] = sum(
            name.lower().endswith(IMAGE_EXTENSIONS)
            for cls in os.scandir(root) if cls.is_dir()
            for name in os.listdir(cls.path)
        )
        if counts[split] == 0:
            raise UserError(f"{root} holds no images; put one sub-folder per class in it, with the images inside")
    return counts["train"]


def download_cifar10(data_dir: str, timeout_s: float = 60.0) -> None:
    """Fetch and unpack CIFAR-10 into data_dir unless it is there already (torchvision checks md5 sums).
    Call it from one process per machine only: ranks downloading at once corrupt the archive."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)  # torchvision's download sets no timeout of its own
    try:
        CIFAR10(data_dir, train=True, download=True)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(
            f"could not download CIFAR-10 into {data_dir} ({reason}); on an offline machine copy "
            f"{CIFAR_ARCHIVE} into {data_dir}/ by hand and rerun, or use --dataset=imagefolder"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)


# ----------------------------------------------------------------------------- readers


def load_dataset(dataset: str, data_dir: str, synthetic_size: int, seed: int) -> tuple[ImageSet, ImageSet]:
    """(train, test) as uint8 tensors on the CPU."""
    if dataset == "cifar10":
        return read_cifar10(data_dir, train=True), read_cifar10(data_dir, train=False)
    if dataset == "imagefolder":
        train = read_image_folder(os.path.join(data_dir, "train"))
        test = read_image_folder(os.path.join(data_dir, "test"))
        if test.classes != train.classes:
            raise UserError(f"{data_dir}/train and {data_dir}/test hold different class folders; give both the same classes")
        return train, test
    return make_synthetic(synthetic_size, seed, split=0), make_synthetic(max(synthetic_size // 5, 1), seed, split=1)


def read_cifar10(data_dir: str, train: bool) -> ImageSet:
    try:
        cifar = CIFAR10(data_dir, train=train, download=False)
    except RuntimeError:  # "Dataset not found or corrupted"
        raise UserError(f"CIFAR-10 is missing or corrupt in {data_dir}; delete it there and rerun to download "
                        f"it again, or copy {CIFAR_ARCHIVE} into {data_dir}/ by hand") from None
    images = torch.from_numpy(cifar.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return ImageSet(images, torch.tensor(cifar.targets, dtype=torch.int64), list(cifar.classes))


def read_image_folder(root: str) -> ImageSet:
    """One sub-folder per class (sorted names give the labels); images of another size are resized."""
    folder = ImageFolder(root)
    images = torch.empty(len(folder), 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
    for i, (path, _) in enumerate(folder.samples):
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (IMAGE_SIZE, IMAGE_SIZE):
                image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
            images[i] = pil_to_tensor(image)
    return ImageSet(images, torch.tensor(folder.targets, dtype=torch.int64), list(folder.classes))


def make_synthetic(size: int, seed: int, split: int, num_classes: int = 10) -> ImageSet:
    """CIFAR-shaped images that a network can learn: each class has its own smooth colour pattern
    (smooth, so that crops and flips keep it recognisable), and every image adds strong noise."""
    patterns = torch.rand(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    patterns = F.interpolate(patterns, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed * 1_000 + 1 + split)  # train and test: same classes, other images
    labels = torch.randint(num_classes, (size,), generator=g)
    noise = torch.randn(size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    images = (255 * (0.25 + 0.5 * patterns[labels]) + 60 * noise).clamp(0, 255).to(torch.uint8)
    return ImageSet(images, labels, [f"class_{c}" for c in range(num_classes)])


# ----------------------------------------------------------------------------- sharding and augmentation


def seed_for(*parts: int) -> int:
    """One 63-bit seed from several integers (SEED, epoch, rank, ...)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**63)
    return value


def shard_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's shard of the epoch: every rank draws the same permutation (from seed and epoch)
    and takes every world_size-th entry of it. The shards are disjoint and equal-sized; the last
    n % world_size entries of the permutation sit out this epoch. Striding (not slicing) makes step
    s of every rank together use permutation[s*B:(s+1)*B]: the same global batches at any world size."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed_for(seed, epoch)))
    usable = n - n % world_size
    return permutation[rank:usable:world_size]


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Indices that fall off either edge mirror back into 0..size-1 (reflect padding)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def crop_and_flip(pixels: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops of a reflect-padded image (shifts of up to `pad` pixels) and random horizontal
    flips, drawn per image, done with one gather. pixels: uint8 (B, H, W, C); returns the same shape."""
    batch, height, width, _ = pixels.shape
    device = pixels.device
    shifts = torch.randint(-pad, pad + 1, (2, batch, 1), generator=generator, device=device)
    rows = _reflect(torch.arange(height, device=device) + shifts[0], height)
    cols = _reflect(torch.arange(width, device=device) + shifts[1], width)
    flip = torch.rand(batch, 1, generator=generator, device=device) < 0.5
    cols = torch.where(flip, width - 1 - cols, cols)
    image = torch.arange(batch, device=device)[:, None, None]
    return pixels[image, rows[:, :, None], cols[:, None, :]]


class DeviceLoader:
    """One split on the training device: per-epoch shards, batches by indexing, augmentation and
    normalisation on the device. Batches come out as float32 in channels_last layout."""

    def __init__(self, data: ImageSet, device: torch.device, augment: bool = False) -> None:
        self.pixels = data.images.permute(0, 2, 3, 1).contiguous().to(device)  # NHWC: a batch is one gather
        self.labels = data.labels.to(device)
        self.device = device
        self.augment = augment
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.labels)

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        local_batch = global_batch // world_size
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed_for(seed, epoch, rank))  # augmentation differs per rank
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch:(step + 1) * local_batch]
            pixels = self.pixels[batch]
            if self.augment:
                pixels = crop_and_flip(pixels, CROP_PAD, generator)
            yield self.normalise(pixels), self.labels[batch]

    def eval_batches(self, world_size: int, rank: int, batch_size: int = 1000
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        part = torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank]
        for batch in part.split(batch_size):
            yield self.normalise(self.pixels[batch]), self.labels[batch]

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW; the permuted view already has channels_last strides."""
        x = (pixels.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last)
