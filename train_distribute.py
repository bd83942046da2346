"""Train the seed's ResNet on CIFAR-10 with DistributedDataParallel (NCCL on GPUs, gloo on CPUs).

    python train_distribute.py                          # every GPU of this machine, or 2 CPU processes
    python train_distribute.py --epochs 5 --width 16    # override any setting below for one run
    python train_distribute.py --help                   # every setting, its default and what it does
    torchrun --standalone --nproc_per_node=4 train_distribute.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 train_distribute.py

Edit a setting below and rerun. Rank 0 prints one line per epoch and writes OUTPUT_DIR/pytorch_res.csv,
pytorch_res.png and checkpoint.pt. Comments starting "DDP:" mark where the script meets DistributedDataParallel
and where every rank must take part; calls through `resume.`, `processes.` and `outputs.` keep runs safe and can be
skipped on a first read, but those marked DDP: (and every `all_ranks_` function) must still run on every rank.

What the default recipe does, and what it measured (docs/performance.md and docs/accuracy.md have the tables; CPU
figures from 2 ranks on a 2-core x86 CPU with AVX512-bf16 unless named; "points": holdout accuracy at width 16
after 5 epochs, mean of 2 seeds):
  - the data set on the device as uint8; batches cut by indexing; crops, flips and normalisation batched there:
    2.03x the seed's DataLoader pipeline with SGD, 1.92x with Muon, width 64 (python -m benchmarks.throughput)
  - Muon on the convolution filters, Nesterov SGD on the rest (muon.py): +3.5 points (0.8170 -> 0.8522),
    about 1.2x the time per epoch; one-cycle LR (20% warm-up, 0.4 per 512 images), weight decay 5e-4
  - label smoothing 0.2: +1.7 points; flip test-time augmentation +1.1 and a ReLU after each residual sum (the
    seed has none) +3.3 points (one seed, an earlier version)
  - bf16 autocast where bf16 is native (1.97x fp32 on that CPU); fp32 where it is emulated (AVX2 CPUs)
  - channels_last: 1.17x the contiguous layout on a 2-core AVX2 CPU at width 16
  - files written on a background thread: the time between two epochs' clocks 1.09x -> 1.00x the epoch itself
    (width 8, 2 AVX2 CPU ranks: python -m benchmarks.writer_stall)
"""

import math
import os
import sys
import time
from contextlib import closing, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import config
import data
import distribute_tools
import loaders
import muon
import outputs
import processes
import resume
from distribute_tools import DistInfo
from processes import UserError
from resnet import ResNet

# ----------------------------------------------------------------------------- settings
# data
DATASET: Literal["cifar10", "imagefolder", "synthetic"] = "cifar10"  # downloaded, your images, or generated
DATA_DIR: str = "./data"  # CIFAR-10 is downloaded here; imagefolder reads DATA_DIR/train/<class>/ and test/<class>/
SYNTHETIC_SIZE: int = 10_000  # training images of DATASET="synthetic" (and a fifth as many test images)
OUTPUT_DIR: str = "./output"  # CSV, picture and checkpoint; an earlier run's files there move to previous-<time>/
IMAGE_SIZE: int = 32  # images of another size are stretched to this square; CIFAR-10 is 32
LOADER: Literal["auto", "memory", "stream"] = "auto"  # memory: the set on the device; stream: files read as it trains
NUM_WORKERS: int = -1  # stream: decoding processes per rank; -1: the rank's share of the cores less one (min. 1)

# model
WIDTH: int = 64  # channels of the first layer: 64 is the seed's network (9.6 M parameters); 8 or 16 for quick runs
RELU_AFTER_SUM: bool = True  # ReLU on each residual block's sum, as standard ResNets do; False: the seed's block

# recipe
# the seed's: OPTIMIZER=adam LR=1e-3 SCHEDULE=constant BATCH_SIZE=256 EPOCHS=100 WEIGHT_DECAY=0 LABEL_SMOOTHING=0
# AUGMENT=False TTA=False RELU_AFTER_SUM=False
EPOCHS: int = 30  # passes over the training set
BATCH_SIZE: int = 512  # global batch: images per optimizer step over all ranks together, split evenly between them
OPTIMIZER: Literal["sgd", "adam", "muon"] = "muon"  # muon: Muon on the filters, sgd on the rest; adam: the seed's
LR: float = 0.4  # peak learning rate; sgd, muon: per 512 images (the run uses LR * BATCH_SIZE / 512); adam: as given
SCHEDULE: Literal["onecycle", "constant"] = "onecycle"  # onecycle: linear warm-up to the peak, then down to 0
WARMUP: float = 0.2  # onecycle: fraction of all steps spent warming up
MOMENTUM: float = 0.9  # sgd, muon: Nesterov momentum
WEIGHT_DECAY: float = 5e-4  # L2 penalty, multiplied by the (batch-scaled) LR each step
LABEL_SMOOTHING: float = 0.2  # share of each training target spread evenly over all classes (0: plain cross-entropy)
AUGMENT: bool = True  # random crops (shifts of up to an eighth of the image, reflect padding) and flips, on the device
TTA: bool = True  # test-time augmentation: average the logits of each test image and its mirror image
MUON_SCALE: float = 0.1  # muon: the filters' orthogonalised step, per unit of LR (the run's, batch-scaled)
SEED: int = 0  # model init, data order and augmentation derive from SEED, the epoch and the rank only

# speed and hardware (a resumed run may change these)
AMP: bool = True  # bf16 autocast on GPUs and on CPUs with native bf16 (fp32 elsewhere, or when False)
COMPILE: bool = False  # torch.compile the model: faster steps after a minute or more of compiling
ACCUMULATE: int = 1  # split each rank's share of a batch into this many micro-batches (less memory, same recipe)
SYNC_BN: bool = False  # GPUs: BatchNorm statistics over the global batch instead of each rank's share (small batches)
BF16_ALLREDUCE: bool = False  # all-reduce gradients in bf16: half the bytes on the wire (many GPUs, slow links)

# processes
WORLD_SIZE: int = 0  # processes to spawn: 0 = one per GPU (2 on a machine without GPUs); torchrun decides there
RESUME: bool = False  # continue the run in OUTPUT_DIR from its checkpoint.pt (restarts by torchrun/SLURM do it anyway)
COLLECTIVE_TIMEOUT: int = 600  # seconds a rank waits for the others in a collective before the run fails
PROGRESS_EVERY: int = 20  # steps between progress-bar refreshes on a terminal (one host sync each)


# ----------------------------------------------------------------------------- one rank's run


@dataclass
class Run:
    """What one rank trains with. Built once; the epoch loop reads it."""

    cfg: SimpleNamespace
    dist_info: DistInfo
    model: nn.Module  # the plain network: evaluation and checkpoints use it
    ddp_model: nn.Module  # the same network wrapped in DDP (and compiled with COMPILE): training steps use it
    optimizer: torch.optim.Optimizer
    train_data: loaders.Loader
    test_data: loaders.Loader
    data: dict[str, Any]  # what the checkpoint records of the data: identity, classes, normalisation
    bf16: bool
    launched_at: float  # time.time() when the launcher started (under torchrun: when this worker started)

    @property
    def steps_per_epoch(self) -> int:
        return self.train_data.steps_per_epoch(self.cfg.BATCH_SIZE)

    def autocast(self) -> Any:
        return torch.autocast(self.dist_info.device.type, dtype=torch.bfloat16, enabled=self.bf16)


def main_worker(rank: int, world_size: int, cfg: SimpleNamespace, launched_at: float) -> None:
    """Everything one rank does, from joining the group to leaving it."""
    with distribute_tools.process_group(rank, world_size, cfg.COLLECTIVE_TIMEOUT) as dist_info:  # DDP: join and leave
        if not resume.all_ranks_finished(cfg, dist_info):  # DDP: every rank asks; a late requeue has nothing to do
            train(build_run(cfg, dist_info, launched_at))  # nothing left holds the model: the group can be destroyed


def build_run(cfg: SimpleNamespace, dist_info: DistInfo, launched_at: float) -> Run:
    """Data on the device, the network wrapped in DDP, the optimizer."""
    # DDP: every rank, the same data (checked); held on the device, or streamed with a DistributedSampler
    train_data, test_data, record = data.load(cfg, dist_info, torch.channels_last)
    device = dist_info.device
    torch.backends.cudnn.benchmark = device.type == "cuda"  # fixed shapes: pick the fastest convolution once
    torch.manual_seed(cfg.SEED)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = make_model(cfg, len(record["classes"]))
    distribute_tools.route_around_cpu_crashes(model, device)  # a oneDNN bug on AVX-512 CPUs: docs/cpu-kinds.md
    if cfg.SYNC_BN:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # GPUs only: refused on CPUs before the start
    model = model.to(device, memory_format=torch.channels_last)  # what tensor cores want; faster on CPUs too
    ddp_model: nn.Module = DistributedDataParallel(  # DDP: wrap the model; gradients are all-reduced in buckets
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **distribute_tools.NO_BUFFER_SYNC,
    )
    if cfg.BF16_ALLREDUCE:
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if cfg.COMPILE:
        ddp_model = torch.compile(ddp_model)  # after wrapping, so DDP's bucketed all-reduce keeps overlapping
    bf16 = cfg.AMP and distribute_tools.bf16_is_fast(device)  # autocast, and Muon's larger products
    optimizer = make_optimizer(cfg, model, device, bf16)
    return Run(cfg, dist_info, model, ddp_model, optimizer, train_data, test_data, record, bf16, launched_at)


def make_model(cfg: SimpleNamespace, num_classes: int) -> nn.Module:
    """The network. Swap in yours here: any module that maps a batch of images to logits."""
    return ResNet(cfg.WIDTH, num_classes=num_classes, relu_after_sum=cfg.RELU_AFTER_SUM)


def make_optimizer(cfg: SimpleNamespace, model: nn.Module, device: torch.device, bf16: bool) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere; muon: muon.py."""
    if cfg.OPTIMIZER == "muon":
        return muon.MuonSGD(model.parameters(), peak_lr(cfg), cfg.MOMENTUM, cfg.WEIGHT_DECAY, cfg.MUON_SCALE, bf16)
    kernels = {"fused" if device.type == "cuda" else "foreach": True}
    options: dict[str, Any] = {"lr": peak_lr(cfg), "weight_decay": cfg.WEIGHT_DECAY, **kernels}
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)


# ----------------------------------------------------------------------------- the epoch loop


def train(run: Run) -> None:
    """The epochs: train, evaluate, report; rank 0 hands each epoch's files to a background writer."""
    cfg, is_main = run.cfg, run.dist_info.is_main
    # DDP: every rank; rank 0 locks OUTPUT_DIR; a resumed run gets its weights, optimizer state and rows back
    with resume.start(cfg, run.dist_info, run.data, run.model, run.optimizer) as history:
        writer = outputs.ResultWriter(cfg.OUTPUT_DIR) if is_main else None  # DDP: rank 0 alone writes files
        if is_main:
            print(outputs.describe(run, peak_lr(cfg)), flush=True)
        earlier_seconds = history[-1]["elapsed_seconds"] if history else 0.0  # a resumed run's clock goes on
        try:
            for epoch in range(len(history) + 1, cfg.EPOCHS + 1):
                started = time.perf_counter()
                (loss_sum, correct, images), train_seconds, lr = train_epoch(run, epoch)
                test_loss, acc = evaluate(run)
                epoch_seconds = time.perf_counter() - started
                # DDP: every rank; rank 0 waits for the previous epoch's files (a failed write stops every rank)
                waited = distribute_tools.all_ranks_try(writer.wait if writer else None) or 0.0
                row = {  # the columns are defined, in this order, in outputs.COLUMNS
                    "epoch": epoch,
                    "loss": loss_sum / images,
                    "acc": acc,
                    "test_loss": test_loss,
                    "train_acc": correct / images,
                    "lr": lr,
                    "epoch_seconds": epoch_seconds,
                    "elapsed_seconds": earlier_seconds + time.time() - run.launched_at,
                    "images_per_second": images / train_seconds,
                    "peak_memory_mb": outputs.all_ranks_peak_memory_mb(run.dist_info.device),  # DDP: max of ranks
                    "write_wait_seconds": waited,
                }
                history.append(outputs.checked_row(row))  # plain numbers, every key a column
                if writer:
                    writer.submit(checkpoint(run, history), history)
                    print(outputs.epoch_line(row, cfg.EPOCHS), flush=True)
        finally:
            if writer:
                writer.close()  # every completed epoch's files are on disk before this rank leaves
        processes.finished()  # from here a Ctrl-C or stop signal changes nothing: the run is complete
        if is_main:
            print(outputs.summary_line(history, cfg.OUTPUT_DIR), flush=True)


def checkpoint(run: Run, history: list[dict[str, float]]) -> dict[str, Any]:
    """What checkpoint.pt holds: weights (no DDP prefixes), optimizer, the rows so far, what resume checks."""
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "history": history}
    return {**state, "epoch": len(history), "config": vars(run.cfg), "data": run.data, "run_ids": resume.run_ids()}


# ----------------------------------------------------------------------------- training


def peak_lr(cfg: SimpleNamespace) -> float:
    """SGD's (and Muon's) learning rate grows linearly with the global batch (LR is per 512 images); Adam's is used
    as given."""
    return cfg.LR * cfg.BATCH_SIZE / 512 if cfg.OPTIMIZER != "adam" else cfg.LR


def lr_at(step: int, total_steps: int, peak: float, schedule: str, warmup: float) -> float:
    """The learning rate of optimizer step `step` (0-based) out of `total_steps`."""
    if schedule == "constant":
        return peak
    warmup_steps = max(1, round(warmup * total_steps))
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak * (total_steps - step) / max(1, total_steps - warmup_steps)


def loss_function(cfg: SimpleNamespace) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING)


def train_epoch(run: Run, epoch: int) -> tuple[list[float], float, float]:
    """One epoch of training steps. Returns the all-ranks sums [loss x images, correct, images], this rank's
    seconds of training (steps only) and the last step's learning rate."""
    cfg, dist_info, steps = run.cfg, run.dist_info, run.steps_per_epoch
    sums = torch.zeros(3, device=dist_info.device)  # on the device: no host sync per step
    run.ddp_model.train()
    distribute_tools.synchronize(dist_info.device)
    started, lr, loss_fn = time.perf_counter(), 0.0, loss_function(cfg)
    # DDP: this rank's shard of the epoch (every rank draws the same permutation and takes its own part)
    batches = run.train_data.train_batches(cfg.BATCH_SIZE, dist_info.world_size, dist_info.rank, cfg.SEED, epoch)
    bar = outputs.Progress(dist_info.is_main, cfg.PROGRESS_EVERY, epoch, cfg.EPOCHS, steps, dist_info.world_size)
    with closing(bar):  # closed however the epoch ends: a line that ends the run starts on a clean line
        for step, (x, y) in enumerate(batches):
            lr = lr_at((epoch - 1) * steps + step, cfg.EPOCHS * steps, peak_lr(cfg), cfg.SCHEDULE, cfg.WARMUP)
            train_step(run, x, y, lr, loss_fn, sums)
            bar.update(step, sums)
    distribute_tools.synchronize(dist_info.device)
    seconds = time.perf_counter() - started
    dist.all_reduce(sums)  # DDP: the epoch's sums over all ranks, once
    loss_sum, correct, images = sums.tolist()
    if not math.isfinite(loss_sum):  # every rank sees the same sums: all stop, the last good checkpoint stays
        kept = f"kept the checkpoint of epoch {epoch - 1}" if epoch > 1 else "no checkpoint was written"
        message = f"the training loss became {loss_sum} in epoch {epoch}; stopped every rank and {kept} in "
        raise UserError(message + f"{cfg.OUTPUT_DIR}; lower --lr (now {cfg.LR}) and start a new run")
    return [loss_sum, correct, images], seconds, lr


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, lr: float, loss_fn: nn.Module, sums: torch.Tensor) -> None:
    """One optimizer step on this rank's share of the global batch, in ACCUMULATE micro-batches. Adds
    [loss x images, correct, images] to the device tensor `sums` (no host sync)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    micro_batches = list(zip(x.chunk(run.cfg.ACCUMULATE), y.chunk(run.cfg.ACCUMULATE), strict=True))
    for i, (xs, ys) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with run.autocast(), nullcontext() if last else run.ddp_model.no_sync():  # DDP: all-reduce in the last only
            logits = run.ddp_model(xs)
            loss = loss_fn(logits, ys)
        (loss * (len(ys) / len(y))).backward()  # DDP: gradients are averaged over the ranks during backward
        sums[0] += loss.detach().float() * len(ys)
        sums[1] += (logits.argmax(dim=1) == ys).sum()
        sums[2] += len(ys)
    run.optimizer.step()  # DDP: Muon's step broadcasts each rank's share of the filters' updates


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run: Run) -> tuple[float, float]:
    """Mean test loss and accuracy over the whole test set, each image exactly once: every rank evaluates its own
    part with the plain network (never the DDP wrapper), then the sums meet."""
    for buffer in run.model.buffers():  # DDP: every rank evaluates with rank 0's BatchNorm statistics
        dist.broadcast(buffer, src=0)
    run.model.eval()
    sums = torch.zeros(3, device=run.dist_info.device)
    for x, y in run.test_data.eval_batches(run.dist_info.world_size, run.dist_info.rank):
        with run.autocast():
            logits = run.model(x).float()
            if run.cfg.TTA:
                logits = (logits + run.model(x.flip(3)).float()) / 2  # averaged in fp32, not bf16
        sums[0] += F.cross_entropy(logits, y, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == y).sum()
        sums[2] += len(y)
    run.model.train()
    dist.all_reduce(sums)  # DDP: the test sums over all ranks
    loss_sum, correct, images = sums.tolist()
    return loss_sum / images, correct / images


# ----------------------------------------------------------------------------- the launcher


def main(argv: list[str]) -> int:
    """Read and check the settings, get the data ready once, then start the ranks; the run's exit code."""
    launched_at = processes.launcher_started()  # from here a stop signal, too, ends the launcher in one line
    try:
        cfg = config.read_config(__file__, argv)
        world_size = check_before_start(cfg)
        return distribute_tools.run_distribute(main_worker, world_size, cfg, launched_at)  # DDP: a process per rank
    except (UserError, KeyboardInterrupt, processes.Preempted) as error:  # a mistake, or a stop before the ranks
        return processes.report(error, rank=0)  # one line (once per machine): exit 2, 130 or 75


def check_before_start(cfg: SimpleNamespace) -> int:
    """Every check that needs no rank, each one line before anything starts, and the data made ready once; returns
    the world size. Under torchrun every rank runs this, and the ranks prepare the data and claim OUTPUT_DIR."""
    world_size = distribute_tools.resolve_world_size(cfg.WORLD_SIZE)
    config.check_against_machine(cfg, world_size, distribute_tools.gpu_count())
    data.check_sizes(cfg, lambda classes: make_model(cfg, classes), int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if not (resume.finished_here(cfg) or distribute_tools.under_torchrun()):  # finished: the ranks say so
        resume.check_before_start(cfg)
        data.prepare(cfg)  # download, or check every image's header, once for every rank
    return world_size


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
