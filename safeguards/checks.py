"""Every check that needs no rank, each one line naming the fix, before anything starts (in the launcher; under
torchrun in every rank before it joins the group)."""

import functools
import os
import traceback
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import torch

import data
import distribute_tools
from safeguards import settings
from safeguards.failures import UserError, first_line


def read_and_check(script: ModuleType, argv: list[str]) -> tuple[SimpleNamespace, int]:
    """The script's settings and the world size, and every check that needs no rank, before anything starts."""
    cfg = settings.read(script, argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # the first line names the device in use
    world_size = distribute_tools.world_size(cfg.WORLD_SIZE, gpus)
    before_start(cfg, world_size, gpus, lambda classes: script.make_model(cfg, classes), data.sizes(cfg))
    return cfg, world_size


def before_start(
    cfg: SimpleNamespace, world_size: int, gpus: int, make_model: Callable[[int], torch.nn.Module], sizes: tuple
) -> None:
    """The settings against the ranks, the hardware, the data's sizes (train images, classes) and the network."""
    if cfg.WORLD_SIZE < 0 or (gpus and cfg.WORLD_SIZE > gpus) and not distribute_tools.under_torchrun():
        raise UserError(
            f"WORLD_SIZE={cfg.WORLD_SIZE} is no number of ranks for this machine ({gpus} GPUs); use 0 (every GPU, or 2 "
            f"CPU processes) or a count up to the GPUs"
        )
    if distribute_tools.under_torchrun():  # two ranks on one GPU is refused before anything starts
        distribute_tools.choose_device(int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus)
    if cfg.BATCH_SIZE % (world_size * cfg.ACCUMULATE):
        raise UserError(
            f"BATCH_SIZE={cfg.BATCH_SIZE} does not split evenly over {world_size} ranks x {cfg.ACCUMULATE} "
            f"micro-batches; use a multiple of {world_size * cfg.ACCUMULATE}"
        )
    if cfg.SYNC_BN and not gpus:
        raise UserError("SYNC_BN=True needs GPUs (torch's SyncBatchNorm runs on CUDA only); use --sync_bn False")
    if cfg.DATASET == "cifar10" and cfg.IMAGE_SIZE != 32:
        raise UserError(f"IMAGE_SIZE={cfg.IMAGE_SIZE} but CIFAR-10's images are 32x32; use --image_size 32")
    if cfg.LOADER == "stream" and cfg.DATASET != "imagefolder":
        raise UserError(
            f"LOADER='stream' reads image folders; DATASET={cfg.DATASET!r} is held in memory: use --loader auto"
        )
    train_images, classes = sizes
    if train_images < cfg.BATCH_SIZE:
        raise UserError(
            f"the training set has {train_images} images, fewer than one global batch (BATCH_SIZE={cfg.BATCH_SIZE}); "
            f"lower --batch_size"
        )
    for device in ("meta", "cpu"):  # meta allocates nothing; a constructor that computes with tensors needs the CPU
        try:
            with torch.device(device):
                make_model(classes)
            return
        except Exception as e:
            error, where = e, traceback.extract_tb(e.__traceback__)[-1]
    raise UserError(
        f"make_model cannot build the network ({type(error).__name__}: {first_line(error)}, at "
        f"{os.path.basename(where.filename)}:{where.lineno}); fix make_model or the network's settings"
    )


def route_around_cpu_crashes(model: torch.nn.Module, device: torch.device) -> None:
    """On x86 CPUs (AVX-512, and AVX2 too) oneDNN's channels_last weight gradient of a strided 1x1 convolution with
    at most 8 input channels corrupts the heap (docs/cpu-kinds.md). On CPUs such a convolution takes every stride-th
    pixel first and then runs with stride 1: the same function through another kernel."""
    for conv in model.modules() if device.type == "cpu" else ():
        if isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (1, 1) and conv.padding in ((0, 0), "valid"):
            if conv.stride != (1, 1) and conv.in_channels <= 8:
                conv.register_forward_pre_hook(functools.partial(_subsample, stride=conv.stride))
                conv.stride = (1, 1)


def _subsample(conv: torch.nn.Module, inputs: tuple[torch.Tensor], stride: tuple[int, int]) -> tuple[torch.Tensor]:
    return (inputs[0][..., :: stride[0], :: stride[1]],)
