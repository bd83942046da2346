"""Datasets as uint8 tensors, and a loader that shards, augments and batches them on the device.

Every dataset becomes two `ImageSet`s (train, test) of uint8 images, read once. An image folder
is decoded once per machine (every image checked on the way) into a cache file that later runs
and the other ranks load in a fraction of a second. `DeviceLoader` keeps a set on the training
device and per epoch gives this rank its shard of one shared permutation, cut into batches by
indexing, cropped, flipped and normalised on the device: no per-image Python work while training.
"""

import hashlib
import multiprocessing
import os
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distribute_tools import UserError, cpu_cores, file_lock
from outputs import write_atomically

IMAGE_SIZE = 32
Listing = tuple[list[str], list[tuple[str, int]]]  # an image folder's classes, and (path, label) of each image
CROP_PAD = 4  # random crops shift images by up to this many pixels (reflect padding)
# CIFAR-10's per-channel mean and standard deviation, in 0..1 pixel units.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_TRAIN_IMAGES = 50_000
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CACHE_FORMAT = 1  # bump when the cache's content changes meaning
DECODE_CHUNK = 2_000  # images per decoding task


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8, (N, 3, 32, 32)
    labels: torch.Tensor  # int64, (N,)
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def checksum(self) -> int:
        """Cheap, order-sensitive: ranks compare it to find a machine with another copy of the data."""
        position = torch.arange(1, len(self) + 1, dtype=torch.int64)
        # Each image's bytes read as int64 words and summed (wrapping): 40x faster than widening every pixel.
        per_image = self.images.contiguous().view(len(self), -1).view(torch.int64).sum(dim=1)
        return int(((per_image + 7919 * self.labels) * position).sum())


# ----------------------------------------------------------------------------- before training


def prepare(dataset: str, data_dir: str, synthetic_size: int) -> int:
    """What one process per machine does before any rank loads the data: download CIFAR-10, or decode
    and check an image folder into its cache. Returns the number of training images; raises UserError
    naming the file or folder at fault."""
    if dataset == "synthetic":
        return synthetic_size
    if dataset == "cifar10":
        download_cifar10(data_dir)
        return CIFAR_TRAIN_IMAGES
    listings = [list_image_folder(os.path.join(data_dir, split)) for split in ("train", "test")]
    check_same_classes(data_dir, listings[0][0], listings[1][0])  # before seconds of decoding
    for split, listing in zip(("train", "test"), listings, strict=True):
        ensure_decoded(os.path.join(data_dir, split), listing)
    return len(listings[0][1])


def download_cifar10(data_dir: str, timeout_s: float = 60.0) -> None:
    """Fetch and unpack CIFAR-10 into data_dir unless it is there already (torchvision checks md5 sums).
    One process at a time per folder (a file lock): ranks downloading at once corrupt the archive."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    archive = os.path.join(data_dir, CIFAR_ARCHIVE)
    os.makedirs(data_dir, exist_ok=True)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)  # torchvision's download sets no timeout of its own
    try:
        with file_lock(os.path.join(data_dir, ".cifar10.lock")):
            if os.path.exists(archive) and not check_integrity(archive, CIFAR10.tgz_md5):
                raise UserError(
                    f"{archive} is corrupt (its checksum is wrong); delete it and rerun to download "
                    f"it again, or copy a good copy there"
                )
            CIFAR10(data_dir, train=True, download=True)
    except UserError:
        raise
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(
            f"could not download CIFAR-10 into {data_dir} ({reason}); on an offline machine copy "
            f"{CIFAR_ARCHIVE} into {data_dir}/ by hand and rerun, or use --dataset imagefolder"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)


def check_same_classes(data_dir: str, train: list[str], test: list[str]) -> None:
    if train != test:
        only_train, only_test = sorted(set(train) - set(test)), sorted(set(test) - set(train))
        parts = [
            f"only in train/: {', '.join(only_train)}" if only_train else "",
            f"only in test/: {', '.join(only_test)}" if only_test else "",
        ]
        raise UserError(
            f"{data_dir}/train and {data_dir}/test hold different class folders "
            f"({'; '.join(p for p in parts if p)}); give both the same class folders"
        )


# ----------------------------------------------------------------------------- readers


def load_dataset(dataset: str, data_dir: str, synthetic_size: int, seed: int) -> tuple[ImageSet, ImageSet]:
    """(train, test) as uint8 tensors on the CPU. Call prepare() first, once per machine."""
    if dataset == "cifar10":
        return read_cifar10(data_dir, train=True), read_cifar10(data_dir, train=False)
    if dataset == "imagefolder":
        train, test = (cached_image_folder(os.path.join(data_dir, split)) for split in ("train", "test"))
        check_same_classes(data_dir, train.classes, test.classes)
        return train, test
    return make_synthetic(synthetic_size, seed, split=0), make_synthetic(max(synthetic_size // 5, 1), seed, split=1)


def read_cifar10(data_dir: str, train: bool) -> ImageSet:
    """CIFAR-10's python batches, read directly (torchvision, a second or more to import in every rank,
    is only needed to download them)."""
    import pickle

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
            f"CIFAR-10 is missing or corrupt in {data_dir}; delete it there and rerun to download "
            f"it again, or copy {CIFAR_ARCHIVE} into {data_dir}/ by hand"
        ) from None
    pixels = torch.cat([torch.as_tensor(batch["data"]) for batch in batches]).view(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.tensor([label for batch in batches for label in batch["labels"]], dtype=torch.int64)
    return ImageSet(pixels.contiguous(), labels, list(classes))


def list_image_folder(root: str) -> Listing:
    """Class names (sorted sub-folder names; hidden folders such as .ipynb_checkpoints are skipped) and
    (path, label) of every image file. Raises UserError for a missing folder or an empty class."""
    if not os.path.isdir(root):
        parent = os.path.dirname(root)
        if not os.path.isdir(parent):
            raise UserError(
                f"DATA_DIR {parent} does not exist; point --data_dir at a folder with train/ and test/ inside"
            )
        raise UserError(
            f"DATA_DIR {parent} has no {os.path.basename(root)}/ folder; DATASET=imagefolder reads "
            f"{parent}/train/<class>/<image> and {parent}/test/<class>/<image>"
        )
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{root} holds no class folders; put one sub-folder per class in it, with the images inside")
    samples = []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.lower().endswith(IMAGE_EXTENSIONS))
        if not files:
            raise UserError(
                f"{os.path.join(root, name)} holds no images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...); "
                f"put the class's images in it or remove the folder"
            )
        samples += [(os.path.join(root, name, f), label) for f in files]
    return classes, samples


def ensure_decoded(root: str, listing: Listing | None = None) -> tuple[str, list[str], int]:
    """Decode the image folder `root` into its cache file unless one for its current files exists;
    returns that file, the classes and the number of images. The cache is keyed by every file's path,
    size and modification time; the first process decodes (under a file lock, so that the other ranks
    and machines sharing the folder wait instead of decoding too). `listing`: list_image_folder(root), if
    the caller has it already."""
    classes, samples = listing or list_image_folder(root)
    path = _cache_path(root, _cache_key(root, classes, samples))
    with file_lock(os.path.join(os.path.dirname(path), f"{os.path.basename(root)}.lock")):
        if not os.path.exists(path):  # written by a rename: if it is there, it is whole
            images = decode_images([p for p, _ in samples], root)
            labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
            _write_cache(path, {"images": images, "labels": labels, "classes": classes})
    return path, classes, len(samples)


def cached_image_folder(root: str) -> ImageSet:
    """The image folder `root`, decoded (once per machine; afterwards loaded in a fraction of a second)."""
    path, _, _ = ensure_decoded(root)
    try:
        cached = torch.load(path, weights_only=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f"the decoded copy {path} cannot be read ({type(e).__name__}); delete it and rerun") from None
    return ImageSet(cached["images"], cached["labels"], cached["classes"])


def decode_images(paths: list[str], root: str) -> torch.Tensor:
    """Every image as 3x32x32 uint8 (others resized), decoded in chunks on all cores. Every file is
    checked: unreadable ones are named in one UserError (a data set is refused rather than silently
    shrunk, and the user learns which files to replace)."""
    chunks = [paths[start : start + DECODE_CHUNK] for start in range(0, len(paths), DECODE_CHUNK)]
    with _decoding_pool(len(chunks)) as pool:
        decoded = list(pool.map(_decode_chunk, chunks))
    images = torch.frombuffer(bytearray(b"".join(pixels for pixels, _ in decoded)), dtype=torch.uint8)
    problems = [problem for _, chunk_problems in decoded for problem in chunk_problems]
    if problems:
        named = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise UserError(
            f"{len(problems)} of {len(paths)} images in {root} cannot be read: {named}; delete or "
            f"replace {'it' if len(problems) == 1 else 'them'} and rerun"
        )
    return images.view(len(paths), 3, IMAGE_SIZE, IMAGE_SIZE)


def _decoding_pool(chunks: int) -> Executor:
    """Processes on Linux (decoding small images is mostly Python work, which threads cannot share out);
    forked, so that they start at once without importing torch again. A thread elsewhere."""
    if chunks > 1 and cpu_cores() > 1 and sys.platform.startswith("linux"):
        return ProcessPoolExecutor(min(cpu_cores(), chunks), mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(1)


def _decode_chunk(paths: list[str]) -> tuple[bytes, list[str]]:
    """Pixels of each image, channels first, as bytes; and "path (reason)" for each unreadable one."""
    import numpy as np
    from PIL import Image

    pixels, problems = [], []
    for path in paths:
        try:
            with Image.open(path) as image:
                image = image.convert("RGB")
                if image.size != (IMAGE_SIZE, IMAGE_SIZE):
                    image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
                pixels.append(np.asarray(image).transpose(2, 0, 1).tobytes())
        except Exception as e:  # truncated, not an image, unsupported: the file is named, whatever the cause
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:80]
            problems.append(f"{path} ({reason})")
            pixels.append(bytes(3 * IMAGE_SIZE * IMAGE_SIZE))
    return b"".join(pixels), problems


def _cache_key(root: str, classes: list[str], samples: list[tuple[str, int]]) -> str:
    digest = hashlib.sha256(f"{CACHE_FORMAT} {IMAGE_SIZE} {classes}".encode())
    for path, label in samples:
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)} {label} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _cache_path(root: str, key: str) -> str:
    """Beside the data (DATA_DIR/.decoded/) where that is writable, else in the user's cache folder."""
    folder = os.path.join(os.path.dirname(os.path.abspath(root)), ".decoded")
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise OSError
    except OSError:
        user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12]
        folder = os.path.join(user_cache, "resnet-ddp", where)
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{os.path.basename(root)}-{key}.pt")


def _write_cache(path: str, content: dict) -> None:
    """Atomically (a temporary name, then a rename), replacing the caches of earlier versions of the folder."""
    split = os.path.basename(path).rsplit("-", 1)[0]
    folder = os.path.dirname(path)
    for name in os.listdir(folder):
        if name.startswith(f"{split}-") and name.endswith(".pt"):
            os.remove(os.path.join(folder, name))
    write_atomically(path, lambda temporary: torch.save(content, temporary))


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
    normalisation on the device. Batches come out as float32 in `memory_format`."""

    def __init__(
        self,
        data: ImageSet,
        device: torch.device,
        augment: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> None:
        self.pixels = data.images.permute(0, 2, 3, 1).contiguous().to(device)  # NHWC: a batch is one gather
        self.labels = data.labels.to(device)
        self.device = device
        self.augment = augment
        self.memory_format = memory_format
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.labels)

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def train_batches(
        self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        local_batch = global_batch // world_size
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed_for(seed, epoch, rank))  # augmentation differs per rank
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch : (step + 1) * local_batch]
            pixels = self.pixels[batch]
            if self.augment:
                pixels = crop_and_flip(pixels, CROP_PAD, generator)
            yield self.normalise(pixels), self.labels[batch]

    def eval_batches(
        self, world_size: int, rank: int, batch_size: int = 1000
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        part = torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank]
        for batch in part.split(batch_size):
            yield self.normalise(self.pixels[batch]), self.labels[batch]

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW in the model's memory format."""
        x = (pixels.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return x.contiguous(memory_format=self.memory_format)
