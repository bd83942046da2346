"""The two loaders, which give each rank its batches of an epoch, cropped, flipped and normalised on the device:

DeviceLoader   a split held on the device: this rank's shard of one shared permutation per epoch, batches cut
               by indexing (no per-image Python work)
StreamLoader   a split of an image folder read from its files: torch's DataLoader with a DistributedSampler,
               its worker processes decoding batches ahead of the steps (image_folder.ImageFiles)
"""

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import image_folder
import processes
from distribute_tools import DistInfo
from processes import UserError

if TYPE_CHECKING:
    from data import ImageSet

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (images, labels) on the device
EVAL_BATCH = 1000  # test images per evaluation batch
STREAM_EVAL_BATCH = 250  # the stream loader's: each of its workers holds a few batches ahead


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


class Loader:
    """What both loaders do on the device: crops and flips for training, normalisation, the model's memory
    format. Batches come out as float32 in `memory_format`."""

    def __init__(
        self,
        device: torch.device,
        augment: bool,
        memory_format: torch.memory_format,
        size: int,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> None:
        self.device, self.augment, self.memory_format = device, augment, memory_format
        self.crop_pad = max(1, round(size / 8))  # 4 pixels at 32x32, 8 at 64x64
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255

    def __len__(self) -> int:
        raise NotImplementedError

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full batches only: a last partial batch is dropped on every rank, every epoch."""
        return len(self) // global_batch

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Batches:
        raise NotImplementedError

    def eval_batches(self, world_size: int, rank: int, batch_size: int = EVAL_BATCH) -> Batches:
        """This rank's contiguous part of the split: over all ranks every image exactly once."""
        raise NotImplementedError

    def training_batch(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.augment:
            pixels = crop_and_flip(pixels, self.crop_pad, generator)
        return self.normalise(pixels)

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> normalised float NCHW in the model's memory format."""
        x = (pixels.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return x.contiguous(memory_format=self.memory_format)


def augmentation_generator(device: torch.device, seed: int, epoch: int, rank: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed_for(seed, epoch, rank))  # augmentation differs per rank
    return generator


class DeviceLoader(Loader):
    """One split held on the training device: per-epoch shards, batches by indexing."""

    def __init__(
        self,
        data: "ImageSet",
        device: torch.device,
        augment: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> None:
        super().__init__(device, augment, memory_format, data.images.shape[-1], data.mean, data.std)
        self.pixels = data.images.to(device).permute(0, 2, 3, 1).contiguous()  # NHWC: a batch is one gather
        self.labels = data.labels.to(device)

    def __len__(self) -> int:
        return len(self.labels)

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Batches:
        local_batch = global_batch // world_size
        indices = shard_indices(len(self), world_size, rank, seed, epoch).to(self.device)
        generator = augmentation_generator(self.device, seed, epoch, rank)
        for step in range(self.steps_per_epoch(global_batch)):
            batch = indices[step * local_batch : (step + 1) * local_batch]
            yield self.training_batch(self.pixels[batch], generator), self.labels[batch]

    def eval_batches(self, world_size: int, rank: int, batch_size: int = EVAL_BATCH) -> Batches:
        part = torch.tensor_split(torch.arange(len(self), device=self.device), world_size)[rank]
        for batch in part.split(batch_size):
            yield self.normalise(self.pixels[batch]), self.labels[batch]


class StreamLoader(Loader):
    """One split of an image folder, read from its files as training goes: torch's DataLoader, whose worker
    processes decode batches ahead of the steps (kept across epochs for training, started for each evaluation;
    on GPUs in pinned memory, copied without blocking the host). A file that fails to decode stops every rank at
    the end of the pass over the split."""

    def __init__(
        self,
        files: image_folder.ImageFiles,
        root: str,
        device: torch.device,
        workers: int,
        augment: bool,
        memory_format: torch.memory_format,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> None:
        super().__init__(device, augment, memory_format, files.size, mean, std)
        self.files, self.root, self.workers = files, root, workers
        self.sampler: DistributedSampler | None = None
        self.readers: dict[str, DataLoader] = {}  # built at the first pass, kept for every later one

    def __len__(self) -> int:
        return len(self.files)

    def train_batches(self, global_batch: int, world_size: int, rank: int, seed: int, epoch: int) -> Batches:
        if "train" not in self.readers:
            # DDP: each rank's shard of one shuffle (from seed and the epoch); drop_last: every rank takes as many
            # steps, each with a full share of the global batch
            self.sampler = DistributedSampler(self.files, world_size, rank, shuffle=True, seed=seed, drop_last=True)
            batch = global_batch // world_size
            self.readers["train"] = file_reader(self.files, batch, self.sampler, self.workers, self.device, True)
        assert self.sampler is not None
        self.sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same one on every rank
        generator = augmentation_generator(self.device, seed, epoch, rank)
        problems: list[str] = []
        for pixels, labels, unreadable in batches_of(self.readers["train"]):
            problems += unreadable
            pixels, labels = pixels.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            yield self.training_batch(pixels, generator), labels
        all_ranks_stop_if_unreadable(problems, len(self), self.root)

    def eval_batches(self, world_size: int, rank: int, batch_size: int = STREAM_EVAL_BATCH) -> Batches:
        if "eval" not in self.readers:  # no sampler: no image is padded in or left out
            part = torch.tensor_split(torch.arange(len(self)), world_size)[rank].tolist()
            self.readers["eval"] = file_reader(
                self.files, batch_size, part, self.workers, self.device, persistent=False
            )
        problems: list[str] = []
        for pixels, labels, unreadable in batches_of(self.readers["eval"]):
            problems += unreadable
            yield self.normalise(pixels.to(self.device, non_blocking=True)), labels.to(self.device, non_blocking=True)
        all_ranks_stop_if_unreadable(problems, len(self), self.root)


def file_reader(
    files: image_folder.ImageFiles,
    batch_size: int,
    sampler: Any,
    workers: int,
    device: torch.device,
    drop_last: bool = False,
    persistent: bool = True,
) -> DataLoader:
    """Batches of `files` in the order of `sampler`, decoded by `workers` processes, each a few batches ahead,
    kept across passes (`persistent`), in pinned memory for GPUs; workers=0: in this process (a debugger reaches
    the decoding)."""
    return DataLoader(
        files,
        batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=workers,
        collate_fn=image_folder.whole_batch,
        worker_init_fn=image_folder.quiet_worker,
        pin_memory=device.type == "cuda",
        persistent_workers=persistent and workers > 0,
        # forked: they start at once (a rank spawned by the launcher would spawn them, importing torch anew)
        multiprocessing_context="fork" if workers and sys.platform.startswith("linux") else None,
        prefetch_factor=4 if workers else None,
    )


def batches_of(reader: DataLoader) -> Iterator:
    """The reader's batches; the worker processes it forks for a pass start with the stop signals held back."""
    with processes.stop_signals_held():
        batches = iter(reader)
    yield from batches


def sample_statistics(
    files: image_folder.ImageFiles, root: str, dist_info: DistInfo, workers: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Channel statistics of image_folder.statistics_sample, each rank decoding its share of it."""
    part = image_folder.statistics_sample(len(files))[dist_info.rank :: dist_info.world_size]
    sums, problems = torch.zeros(3, 3, dtype=torch.int64), []
    for pixels, _, unreadable in batches_of(
        file_reader(files, 256, part, workers, torch.device("cpu"), persistent=False)
    ):
        sums, problems = sums + image_folder.pixel_sums(pixels), problems + unreadable
    all_ranks_stop_if_unreadable(problems, len(files), root)
    sums = sums.to(dist_info.device)
    dist.all_reduce(sums)  # DDP: the sample's sums over every rank's share
    return image_folder.statistics(sums)


def all_ranks_stop_if_unreadable(problems: list[str], total: int, root: str) -> None:
    """DDP: every rank calls it at the same point. A file whose header read when the run started but that a rank's
    workers cannot decode stops every rank together, in one line naming it and what is kept."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = [problem for theirs in everyone for problem in theirs]
    if found:
        raise UserError(
            f"{image_folder.unreadable(found, total, root)}; put back good copies of the files as they were when "
            f"the run started; {processes.kept_files()}"
        )
