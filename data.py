"""The data: two loaders (train, test) of IMAGE_SIZE x IMAGE_SIZE uint8 images, cropped, flipped and normalised on
the device in batches. LOADER decides how images reach the device (one rule for every rank, `choose_loader`):

    memory   `DeviceLoader` keeps a whole split on the device, read once (CIFAR-10's files, generated images, or an
             image folder decoded once per machine into a cache file); per epoch this rank's shard of one shared
             permutation is cut into batches by indexing: no per-image Python work
    stream   `loaders.StreamLoader`, for image folders of any size: torch's DataLoader with a DistributedSampler, its
             worker processes decoding the files as training goes (image_folder.ImageFiles)
"""

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import image_folder
import loaders
import outputs
from distribute_tools import DistInfo, all_ranks_try, cpu_cores, under_torchrun
from processes import UserError, first_line

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's published, 0..1 units
SYNTHETIC_CLASSES = 10
CIFAR_ARCHIVE, CIFAR_SIZES = "cifar-10-python.tar.gz", (50_000, 10_000, 10)  # train images, test images, classes
MEMORY_SHARE = 0.25  # auto: memory while the decoded set takes at most this share of the smallest free memory


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
        pixels = self.images.contiguous().view(len(self), -1)
        # Each image's bytes read as int64 words and summed (wrapping): 40x faster than widening every pixel, which
        # images whose bytes do not fill whole words need.
        per_image = (pixels.view(torch.int64) if pixels.shape[1] % 8 == 0 else pixels.long()).sum(dim=1)
        return int(((per_image + 7919 * self.labels) * position).sum())


def identity(train_images: int, test_images: int, size: int, content: str) -> str:
    """What tells one data set from another (`content`: a checksum of the pixels, or of an image folder's files):
    a resume on other data is refused with it."""
    return f"{train_images:,} train and {test_images:,} test images of {size}x{size}, {content}"


def same_data(saved: str, now: str) -> bool:
    """Whether a checkpoint's identity of its data is this run's. An image folder's identity comes from its
    files; checkpoints written while it came from the decoded pixels ("checksum") are compared by their counts
    and size alone."""
    old_folder = ", checksum " in saved and ", files " in now
    return saved.partition(", ")[0] == now.partition(", ")[0] if old_folder else saved == now


def record(train: ImageSet, test: ImageSet, content: str = "") -> dict[str, Any]:
    """What a checkpoint records of the data: its identity, and what an evaluation of the weights needs."""
    content = content or f"checksum {train.checksum() ^ test.checksum():x}"
    return {
        "identity": identity(len(train), len(test), train.images.shape[-1], content),
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
    (classes, train, _), (test_classes, test, _) = (
        image_folder.list_images(os.path.join(cfg.DATA_DIR, s)) for s in ("train", "test")
    )
    image_folder.check_same_classes(cfg.DATA_DIR, classes, test_classes)
    return len(train), len(test), len(classes)


def prepare(cfg: SimpleNamespace) -> None:
    """What one process per machine does before any rank loads the data: download CIFAR-10, or read the header
    of every image of an image folder (a memory run decodes it fully later). Raises UserError naming the file
    or folder at fault."""
    if cfg.DATASET == "cifar10":
        download_cifar10(cfg.DATA_DIR)
    elif cfg.DATASET == "imagefolder":
        for split in ("train", "test"):  # sizes() has checked the folders and their classes
            image_folder.check_headers(os.path.join(cfg.DATA_DIR, split))


def check_sizes(cfg: SimpleNamespace, make_model: Callable[[int], torch.nn.Module], ranks: int) -> None:
    """Before anything starts: a loader that can read DATASET, at least one global batch of training images, and
    data and model that fit in this machine's memory. Per rank: the uint8 set and its copy on the device
    (generated images pass through float32 noise first; an image folder counts only with LOADER=memory: `auto`
    streams one that would not fit), the weights with their gradients, momentum and the two copies a checkpoint
    makes."""
    if cfg.LOADER == "stream" and cfg.DATASET != "imagefolder":
        raise UserError(
            f"LOADER='stream' reads image folders; DATASET={cfg.DATASET!r} is held in memory (it fits): use "
            f"--loader auto or memory"
        )
    train_images, test_images, classes = sizes(cfg)
    if train_images < cfg.BATCH_SIZE:
        raise UserError(
            f"the training set has {train_images} images, fewer than one global batch (BATCH_SIZE={cfg.BATCH_SIZE}); "
            f"lower --batch_size"
        )
    parameters = count_parameters(make_model, classes)
    held = cfg.DATASET != "imagefolder" or cfg.LOADER == "memory"
    data_bytes = held * (train_images + test_images) * 3 * cfg.IMAGE_SIZE**2 * (10 if cfg.DATASET == "synthetic" else 2)
    needed, here = ranks * (data_bytes + 20 * parameters), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > here:
        fix = "use --loader auto (which streams a set this big), or " if cfg.DATASET == "imagefolder" and held else ""
        raise UserError(
            f"this run needs about {needed / 2**30:,.0f} GB of memory ({ranks} rank(s) x {data_bytes / 2**30:,.1f} GB "
            f"of images and {20 * parameters / 2**30:,.1f} GB for {parameters:,} parameters), more than this "
            f"machine's {here / 2**30:,.0f} GB; {fix}lower --image_size, the number of images or the network's size"
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
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:  # a read-only checkout with the default ./data, say
        raise UserError(
            f"DATA_DIR {data_dir} cannot be created ({e.strerror}); point --data_dir at a writable folder, where "
            f"CIFAR-10 is downloaded"
        ) from None
    socket.setdefaulttimeout(timeout_s)  # torchvision's download sets no timeout of its own
    writable = os.access(data_dir, os.W_OK)  # a read-only shared copy is only read: no lock needed, none possible
    try:
        with outputs.lock_file(os.path.join(data_dir, ".cifar10.lock")) if writable else nullcontext():
            if os.path.exists(archive) and not check_integrity(archive, CIFAR10.tgz_md5):
                raise UserError(
                    f"{archive} is corrupt (its checksum is wrong); delete it and rerun to download it again, "
                    f"or copy a good copy there"
                )
            CIFAR10(data_dir, train=True, download=True)
    except UserError:
        raise
    except Exception as e:
        offline = f"on an offline machine copy {CIFAR_ARCHIVE} into {data_dir}/ by hand and rerun"
        fix = offline if writable else "it is read-only: point --data_dir at a writable folder, or one that holds it"
        raise UserError(
            f"could not download CIFAR-10 into {data_dir} ({first_line(e)}); {fix}, or use --dataset imagefolder"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)


# ----------------------------------------------------------------------------- readers


def load(
    cfg: SimpleNamespace, dist_info: DistInfo, memory_format: torch.memory_format = torch.contiguous_format
) -> tuple["loaders.Loader", "loaders.Loader", dict[str, Any]]:
    """This rank's (train, test) loaders and what the checkpoint records of the data. Under torchrun, where no
    launcher prepared the data, local rank 0 of each machine prepares it first. Every rank must hold the same
    images (a machine with another copy of DATA_DIR would hang or train on other data): their identities meet once."""
    if under_torchrun():
        all_ranks_try(lambda: prepare(cfg) if dist_info.local_rank == 0 else None)
    folder = _image_folder(cfg) if cfg.DATASET == "imagefolder" else None
    content = image_folder.identity(list(zip(*folder[:2], strict=True))) if folder else ""
    images = sum(map(len, folder[1])) if folder else sum(sizes(cfg)[:2])
    loader, how = choose_loader(cfg, dist_info, 3 * cfg.IMAGE_SIZE**2 * images)
    if folder and loader == "stream":
        train, test, recorded = stream_image_folder(cfg, dist_info, memory_format, *folder[:3], content)
    else:
        if folder:  # local rank 0 of each machine decodes an image folder once (finding any damaged file) for all
            decode = lambda: [image_folder.ensure_decoded(root, cfg.IMAGE_SIZE) for root in folder[0]]  # noqa: E731
            all_ranks_try(decode if dist_info.local_rank == 0 else None)
        train_set, test_set = read(cfg)
        train, test = (
            loaders.DeviceLoader(s, dist_info.device, cfg.AUGMENT and s is train_set, memory_format)
            for s in (train_set, test_set)
        )
        recorded = record(train_set, test_set, content)
    workers = f", {train.workers} worker(s) per rank" if isinstance(train, loaders.StreamLoader) else ""
    recorded.update(loader=how + workers, skipped=folder[3] if folder else 0)
    everyone: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(everyone, recorded["identity"])
    others = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if others:
        raise UserError(
            f"rank(s) {', '.join(map(str, others))} loaded other data than rank 0 ({everyone[others[0]]}, against "
            f"{everyone[0]}); give every machine the same copy of DATA_DIR"
        )
    return train, test, recorded


def _image_folder(cfg: SimpleNamespace) -> tuple[list[str], list[image_folder.Samples], list[str], int]:
    """The two splits' folders, their (path, label) lists, the class names and how many entries were skipped."""
    roots = [os.path.join(cfg.DATA_DIR, split) for split in ("train", "test")]
    listed = [image_folder.list_images(root) for root in roots]
    return roots, [samples for _, samples, _ in listed], listed[0][0], sum(skipped for *_, skipped in listed)


def free_memory(dist_info: DistInfo) -> int:
    """Bytes a rank may still fill: its share of this machine's available memory, and on GPUs at most its GPU's
    free memory (the memory loader reads a set into host memory, then moves it to the GPU)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # not Linux
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = available // dist_info.local_world_size
    return min(host, torch.cuda.mem_get_info(dist_info.device)[0]) if dist_info.device.type == "cuda" else host


def choose_loader(cfg: SimpleNamespace, dist_info: DistInfo, decoded_bytes: int) -> tuple[str, str]:
    """ "memory" or "stream", and the first line's words for it; decided alike on every rank, from the smallest
    free memory of any rank. `auto` holds an image folder in memory while its decoded images take at most
    MEMORY_SHARE of that (they are held twice while they are laid out, and the network needs room too)."""
    smallest = torch.tensor([free_memory(dist_info)], dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)  # DDP: every rank decides alike
    free = smallest.item()
    figures = f"{decoded_bytes / 2**30:,.2f} GB of decoded images, {free / 2**30:,.1f} GB free per rank"
    streams = cfg.LOADER == "stream" or (
        cfg.LOADER == "auto" and cfg.DATASET == "imagefolder" and decoded_bytes > MEMORY_SHARE * free
    )
    if not streams and decoded_bytes > free:
        fix = "use --loader stream" if cfg.DATASET == "imagefolder" else "lower --synthetic_size or --image_size"
        raise UserError(f"the data set does not fit in a rank's memory ({figures}); {fix}")
    chosen = "stream" if streams else "memory"
    if cfg.LOADER == "auto" and cfg.DATASET == "imagefolder":
        share = f"{'over' if streams else 'within'} {MEMORY_SHARE:.0%} of the free memory"
        return chosen, f"loader {chosen} (auto: {figures}, {share})"
    return chosen, f"loader {chosen}"


def stream_image_folder(
    cfg: SimpleNamespace,
    dist_info: DistInfo,
    memory_format: torch.memory_format,
    roots: list[str],
    splits: list[image_folder.Samples],
    classes: list[str],
    content: str,
) -> tuple["loaders.StreamLoader", "loaders.StreamLoader", dict[str, Any]]:
    """An image folder read from its files as training goes, normalised with the statistics of a fixed sample
    of its training images (as the memory path is, so that a run may switch loaders on resume)."""
    workers = cfg.NUM_WORKERS if cfg.NUM_WORKERS >= 0 else max(1, cpu_cores() // dist_info.local_world_size - 1)
    train_files, test_files = (image_folder.ImageFiles(samples, cfg.IMAGE_SIZE) for samples in splits)
    mean, std = loaders.sample_statistics(train_files, roots[0], dist_info, workers)
    train, test = (
        loaders.StreamLoader(
            files, root, dist_info.device, workers, cfg.AUGMENT and files is train_files, memory_format, mean, std
        )
        for files, root in ((train_files, roots[0]), (test_files, roots[1]))
    )
    size = cfg.IMAGE_SIZE
    recorded = {"identity": identity(len(train), len(test), size, content), "classes": classes, "mean": mean}
    recorded.update(std=std, image_size=size, resized=0)  # resized images are counted by the memory path only
    return train, test, recorded


def read(cfg: SimpleNamespace) -> tuple[ImageSet, ImageSet]:
    """(train, test) of DATASET, prepared before; the test set is normalised with the training set's statistics."""
    if cfg.DATASET == "cifar10":
        return read_cifar10(cfg.DATA_DIR, train=True), read_cifar10(cfg.DATA_DIR, train=False)
    if cfg.DATASET == "imagefolder":
        train, test = (
            ImageSet(**image_folder.decoded(os.path.join(cfg.DATA_DIR, s), cfg.IMAGE_SIZE)) for s in ("train", "test")
        )
        sample = train.images[image_folder.statistics_sample(len(train))]
        train.mean, train.std = test.mean, test.std = image_folder.channel_statistics(sample)
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
