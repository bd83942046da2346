"""Train the seed's ResNet on CIFAR-10 with DistributedDataParallel (NCCL on GPUs, gloo on CPUs).

    python train_distribute.py                          # every GPU of this machine, or 2 CPU processes
    python train_distribute.py --epochs 5 --width 16    # override any setting below for one run
    python train_distribute.py --help                   # every setting, its default and what it does
    torchrun --standalone --nproc_per_node=4 train_distribute.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 train_distribute.py

Edit a setting below and rerun: that is the main way to configure a run. Rank 0 prints one line
per epoch and writes OUTPUT_DIR/pytorch_res.csv, pytorch_res.png and checkpoint.pt.

What the default recipe does, and what each part measured (machine and command; README.md has the tables):
  - the data set on the device as uint8; batches cut by indexing; crops, flips and normalisation
    batched there: 2.03-2.14x the seed's DataLoader pipeline in bf16 on a 2-core CPU with AVX512-bf16
    (an earlier version of this file); on a 2-core AVX2 CPU both sit at the fp32 compute ceiling,
    21 against 21 images/s, 1.00x the one-process ceiling (python -m benchmarks.throughput)
  - bf16 autocast where bf16 is native: 1.97x fp32 (AVX512-bf16 CPU, width 64); fp32 elsewhere,
    where bf16 is emulated and slower (1.4 against 23 images/s, AVX2 CPU)
  - channels_last: 1.17x the contiguous layout on the AVX2 CPU (compute ceiling: 364 against 311
    images/s at width 16, python -m benchmarks.throughput --width 16 --batch_size 256 --skip_seed
    --steps 10; 21 against 18 at width 64); contiguous below width 8 on CPUs, where torch 2.14 crashes
  - a ReLU after each residual sum (the seed has none): holdout accuracy 0.7830 -> 0.8162, and flip
    test-time augmentation 0.8052 -> 0.8162 on the same weights (width 16, 5 epochs, 2 CPU ranks:
    python train_distribute.py --dataset imagefolder --data_dir DIR --width 16 --epochs 5)
  - Nesterov SGD, one-cycle LR (20% warm-up) with LR 0.4 per 512 images, label smoothing 0.2, weight
    decay 5e-4: the fast CIFAR-10 trainers' recipe; LR 0.2/0.4/0.8 within a point on the check above
  - files written on a background thread: the time between two epochs' clocks 1.09x -> 1.00x the
    epoch itself, 5.3 s less wall clock (width 8, 8 epochs, 2 AVX2 CPU ranks:
    python -m benchmarks.writer_stall)
"""

import inspect
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import config
import data
from distribute_tools import (
    DistInfo,
    UserError,
    bf16_is_fast,
    process_group,
    process_start_time,
    raise_if_any,
    refuse_to_start,
    resolve_world_size,
    restart_count,
    run_distribute,
    run_ids,
    sync_batchnorm,
    under_torchrun,
)
from outputs import (
    Progress,
    ResultWriter,
    check_output_dir,
    checkpoint_epoch,
    claim_output_dir,
    cpu_snapshot,
    epoch_line,
    move_aside_earlier_results,
    no_checkpoint_message,
    read_resume_checkpoint,
    remove_stale_temporaries,
    same_run,
    save_checkpoint,
    summary_line,
    write_csv,
)
from resnet import ResNet

# ----------------------------------------------------------------------------- settings
# data
DATASET: Literal["cifar10", "imagefolder", "synthetic"] = "cifar10"  # downloaded, your images, or generated
DATA_DIR: str = "./data"  # CIFAR-10 is downloaded here; imagefolder reads DATA_DIR/train/<class>/ and test/<class>/
SYNTHETIC_SIZE: int = 10_000  # training images of DATASET="synthetic" (and a fifth as many test images)
OUTPUT_DIR: str = "./output"  # CSV, picture and checkpoint; an earlier run's files there move to previous-<time>/

# model
WIDTH: int = 64  # channels of the first layer: 64 is the seed's network (9.6 M parameters); 8 or 16 for quick runs
RELU_AFTER_SUM: bool = True  # ReLU on each residual block's sum, as standard ResNets do; False: the seed's block

# recipe
# the seed's: OPTIMIZER=adam LR=1e-3 SCHEDULE=constant BATCH_SIZE=256 EPOCHS=100 WEIGHT_DECAY=0 LABEL_SMOOTHING=0
# AUGMENT=False TTA=False RELU_AFTER_SUM=False
EPOCHS: int = 30  # passes over the training set
BATCH_SIZE: int = 512  # global batch: images per optimizer step over all ranks together, split evenly between them
OPTIMIZER: Literal["sgd", "adam"] = "sgd"  # sgd: Nesterov momentum; adam: the seed's
LR: float = 0.4  # peak learning rate; sgd: per 512 images (the run uses LR * BATCH_SIZE / 512); adam: as given
SCHEDULE: Literal["onecycle", "constant"] = "onecycle"  # onecycle: linear warm-up to the peak, then down to 0
WARMUP: float = 0.2  # onecycle: fraction of all steps spent warming up
MOMENTUM: float = 0.9  # sgd: Nesterov momentum
WEIGHT_DECAY: float = 5e-4  # L2 penalty, multiplied by the (batch-scaled) LR each step
LABEL_SMOOTHING: float = 0.2  # share of each training target spread evenly over all classes (0: plain cross-entropy)
AUGMENT: bool = True  # random crops (shifts of up to 4 px, reflect padding) and horizontal flips, on the device
TTA: bool = True  # test-time augmentation: average the logits of each test image and its mirror image
SEED: int = 0  # model init, data order and augmentation derive from SEED, the epoch and the rank only

# speed and hardware (a resumed run may change these)
AMP: bool = True  # bf16 autocast on GPUs and on CPUs with native bf16 (fp32 elsewhere, or when False)
COMPILE: bool = False  # torch.compile the model: faster steps after a minute or more of compiling
ACCUMULATE: int = 1  # split each rank's share of a batch into this many micro-batches (less memory, same recipe)
SYNC_BN: bool = False  # BatchNorm statistics over the global batch instead of each rank's share (small batches)
BF16_ALLREDUCE: bool = False  # all-reduce gradients in bf16: half the bytes on the wire (many GPUs, slow links)

# processes
WORLD_SIZE: int = 0  # processes to spawn: 0 = one per GPU (2 on a machine without GPUs); torchrun decides there
RESUME: bool = False  # continue the run in OUTPUT_DIR from its checkpoint.pt (restarts by torchrun/SLURM do it anyway)
COLLECTIVE_TIMEOUT: int = 600  # seconds a rank waits for the others in a collective before the run fails
PROGRESS_EVERY: int = 20  # steps between progress-bar refreshes on a terminal (one host sync each)

LR_REFERENCE_BATCH = 512  # sgd's LR is stated per this many images
DDP_RENAMED_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
FEW_STEPS = 10  # fewer optimizer steps per epoch than this: warn that the batch is large for the data


def read_config(argv: list[str]) -> SimpleNamespace:
    """The settings above, with the command line's overrides applied and checked (config.py)."""
    usage = __doc__.partition("\nWhat the default recipe")[0]  # --help shows the commands, not the figures
    return config.read_config(config.read_settings(__file__), argv, description=usage)


# ----------------------------------------------------------------------------- one rank's run


@dataclass
class Run:
    """What one rank trains with. Built once; the epoch loop reads it."""

    cfg: SimpleNamespace
    dist_info: DistInfo
    model: nn.Module  # the plain network: evaluation and checkpoints use it
    ddp_model: nn.Module  # the same network wrapped in DDP (and compiled with COMPILE): training steps use it
    optimizer: torch.optim.Optimizer
    train_data: data.DeviceLoader
    test_data: data.DeviceLoader
    bf16: bool
    launched_at: float  # time.time() when the launcher started (under torchrun: when this worker started)
    earlier_seconds: float = 0.0  # a resumed run: the elapsed_seconds its checkpoint had reached

    @property
    def steps_per_epoch(self) -> int:
        return self.train_data.steps_per_epoch(self.cfg.BATCH_SIZE)

    def elapsed(self) -> float:
        return self.earlier_seconds + time.time() - self.launched_at

    def autocast(self) -> Any:
        return torch.autocast(self.dist_info.device.type, dtype=torch.bfloat16, enabled=self.bf16)


def main_worker(rank: int, world_size: int, cfg: SimpleNamespace, launched_at: float) -> None:
    """Everything one rank does, from joining the group to leaving it."""
    with process_group(rank, world_size, cfg.COLLECTIVE_TIMEOUT) as dist_info:
        if under_torchrun():  # nothing ran before the workers: one per machine gets the data ready
            prepare_data_on_each_machine(cfg, dist_info)
        run = build_run(cfg, dist_info, launched_at)
        with own_output_dir(cfg, dist_info):  # rank 0 is the only writer of OUTPUT_DIR
            history = start_or_resume(run)
            train(run, history)


# ----------------------------------------------------------------------------- building the run


def prepare_data_on_each_machine(cfg: SimpleNamespace, dist_info: DistInfo) -> None:
    """Under torchrun: local rank 0 of every machine downloads CIFAR-10 or decodes and checks an image
    folder (file locks keep machines that share DATA_DIR from doing it twice); a failure stops all ranks."""
    error = None
    if dist_info.local_rank == 0:
        try:
            data.prepare(cfg.DATASET, cfg.DATA_DIR, cfg.SYNTHETIC_SIZE)
        except UserError as e:
            error = str(e)
    raise_if_any(error)


def build_run(cfg: SimpleNamespace, dist_info: DistInfo, launched_at: float) -> Run:
    """Data on the device, the network wrapped in DDP, the optimizer."""
    train_set, test_set = data.load_dataset(cfg.DATASET, cfg.DATA_DIR, cfg.SYNTHETIC_SIZE, cfg.SEED)
    check_same_data_everywhere(train_set, test_set)
    device, memory_format = dist_info.device, choose_memory_format(dist_info.device, cfg.WIDTH)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest convolution once
    torch.manual_seed(cfg.SEED)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = ResNet(cfg.WIDTH, num_classes=len(train_set.classes), relu_after_sum=cfg.RELU_AFTER_SUM)
    if cfg.SYNC_BN:
        model = sync_batchnorm(model, device)
    model = model.to(device, memory_format=memory_format)
    # Evaluation gives every rank rank 0's BatchNorm statistics itself: no buffer broadcast before every step
    # (torch 2.14 renamed the option).
    no_buffer_sync = {"forward_sync_buffers" if DDP_RENAMED_SYNC else "broadcast_buffers": False}
    ddp_model: nn.Module = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **no_buffer_sync,
    )
    if cfg.BF16_ALLREDUCE:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if cfg.COMPILE:
        ddp_model = torch.compile(ddp_model)  # after wrapping, so DDP's bucketed all-reduce keeps overlapping
    run = Run(
        cfg,
        dist_info,
        model,
        ddp_model,
        make_optimizer(cfg, model, device),
        data.DeviceLoader(train_set, device, augment=cfg.AUGMENT, memory_format=memory_format),
        data.DeviceLoader(test_set, device, memory_format=memory_format),
        bf16=cfg.AMP and bf16_is_fast(device),
        launched_at=launched_at,
    )
    if run.steps_per_epoch == 0:
        raise UserError(
            f"the training set has {len(train_set)} images, fewer than one global batch "
            f"(BATCH_SIZE={cfg.BATCH_SIZE}); lower --batch_size"
        )
    return run


def choose_memory_format(device: torch.device, width: int) -> torch.memory_format:
    """channels_last: what tensor cores want, and 1.17x faster on CPUs too at width 16 (2-core AVX2 CPU;
    README, Performance). Not on CPUs below width 8, where torch's CPU kernels crash with it when a
    rank has one thread (torch 2.14; "free(): invalid next size")."""
    return torch.contiguous_format if device.type == "cpu" and width < 8 else torch.channels_last


@contextmanager
def own_output_dir(cfg: SimpleNamespace, dist_info: DistInfo) -> Iterator[None]:
    """Rank 0 holds OUTPUT_DIR's lock for the whole run; if another run holds it, every rank stops."""
    lock, error = None, None
    if dist_info.is_main:
        try:
            lock = claim_output_dir(cfg.OUTPUT_DIR)
        except UserError as e:
            error = str(e)
    raise_if_any(error)
    try:
        yield
    finally:
        if lock:
            lock.close()  # releases it


def check_same_data_everywhere(train_set: data.ImageSet, test_set: data.ImageSet) -> None:
    """Every rank must hold the same data (a machine with another copy of DATA_DIR would hang or
    train on other images): sizes and a checksum meet once; a mismatch stops every rank."""
    mine = (len(train_set), len(test_set), train_set.checksum(), test_set.checksum())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    others = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if others:
        raise UserError(
            f"rank(s) {', '.join(map(str, others))} loaded other data than rank 0 "
            f"({everyone[others[0]][0]:,} against {everyone[0][0]:,} training images, or other "
            f"content); give every machine the same copy of DATA_DIR"
        )


def make_optimizer(cfg: SimpleNamespace, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere."""
    options: dict[str, Any] = {
        "lr": peak_lr(cfg),
        "weight_decay": cfg.WEIGHT_DECAY,
        "fused" if device.type == "cuda" else "foreach": True,
    }
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)


def start_or_resume(run: Run) -> list[dict[str, float]]:
    """The epochs already done: none for a new run (an earlier run's files move aside), the newest
    checkpoint's for a resumed or restarted one (the CSV is rewritten from it: rows written after the
    checkpoint, if any, belong to an epoch that runs again)."""
    cfg, dist_info = run.cfg, run.dist_info
    checkpoint, source = newest_checkpoint(cfg, dist_info)
    history = restore(run, checkpoint) if checkpoint else []
    if dist_info.is_main:
        remove_stale_temporaries(cfg.OUTPUT_DIR)
        if checkpoint:
            if source != 0:  # it lay on another machine's disk: this one writes from now on
                moved = move_aside_earlier_results(cfg.OUTPUT_DIR)  # an older epoch, or another run's
                if moved:
                    print(f"moved the older results in {cfg.OUTPUT_DIR} to {moved}")
                save_checkpoint(checkpoint, cfg.OUTPUT_DIR)
            write_csv(history, cfg.OUTPUT_DIR)
            where = f" (the checkpoint of rank {source}'s machine)" if source else ""
            print(f"resuming after epoch {len(history)} of {cfg.EPOCHS}{where}")
        else:
            moved = move_aside_earlier_results(cfg.OUTPUT_DIR)
            if moved:
                print(f"moved the earlier run's results in {cfg.OUTPUT_DIR} to {moved}")
        print(describe(run), flush=True)
        if under_torchrun() and cfg.WORLD_SIZE not in (0, dist_info.world_size):
            print(
                f"warning: WORLD_SIZE={cfg.WORLD_SIZE} is ignored under torchrun, which started "
                f"{dist_info.world_size} ranks"
            )
        if run.steps_per_epoch < FEW_STEPS:
            print(
                f"warning: an epoch has only {run.steps_per_epoch} steps ({len(run.train_data):,} images, global "
                f"batch {cfg.BATCH_SIZE}); the recipe needs more: lower --batch_size for a data set this small"
            )
    return history


def newest_checkpoint(cfg: SimpleNamespace, dist_info: DistInfo) -> tuple[dict[str, Any] | None, int]:
    """With RESUME, or when torchrun or SLURM restarted the run: the newest checkpoint on any machine
    (OUTPUT_DIR may be a local disk, and global rank 0 may now sit on another machine than before),
    read where it lies and sent to every rank, and the rank it came from. None for a new run.
    Every rank takes part: whether this is a restart is decided from what all ranks know."""
    epoch, saved_by = checkpoint_epoch(cfg.OUTPUT_DIR) if dist_info.local_rank == 0 else (-1, {})
    everyone: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(everyone, (epoch, saved_by, dist_info.restarted))
    restarted = any(flag for _, _, flag in everyone)
    if not (cfg.RESUME or restarted):
        return None, 0
    # A restart continues its own run only (another machine's disk may hold an older run's checkpoint);
    # RESUME=True continues whatever checkpoint there is, if its settings match.
    ours = run_ids()
    epochs = [epoch if cfg.RESUME or not ours or same_run(saved_by, ours) else -1 for epoch, saved_by, _ in everyone]
    if max(epochs) < 0:
        if not restarted:
            raise UserError(no_checkpoint_message(cfg.OUTPUT_DIR))  # every rank sees the same epochs
        return None, 0  # restarted before its first checkpoint: it starts again
    source = 0 if epochs[0] == max(epochs) else epochs.index(max(epochs))
    checkpoint_or_reason: list[Any] = [None, None]  # the checkpoint, or why it cannot be used
    if dist_info.rank == source:
        try:
            checkpoint_or_reason[0] = read_resume_checkpoint(cfg)
        except UserError as e:
            checkpoint_or_reason[1] = str(e)
    dist.broadcast_object_list(checkpoint_or_reason, src=source)
    if checkpoint_or_reason[1]:
        raise UserError(checkpoint_or_reason[1])
    return checkpoint_or_reason[0], source


def restore(run: Run, state: dict[str, Any]) -> list[dict[str, float]]:
    """Load weights and optimizer state; returns the epochs already done (the CSV's rows)."""
    if state["steps_per_epoch"] != run.steps_per_epoch:  # the same settings, but other data
        raise UserError(
            f"RESUME=True but an epoch now has {run.steps_per_epoch} steps, the checkpoint's "
            f"{state['steps_per_epoch']}: the training set changed; resume on the same data"
        )
    run.model.load_state_dict(state["model"])
    optimizer_state = state["optimizer"]
    for saved, current in zip(optimizer_state["param_groups"], run.optimizer.param_groups, strict=True):
        for key in ("fused", "foreach"):  # this machine's kernels, not the saving machine's
            saved[key] = current.get(key)
    run.optimizer.load_state_dict(optimizer_state)
    history = list(state["history"])
    run.earlier_seconds = history[-1]["elapsed_seconds"] if history else 0.0
    return history


def describe(run: Run) -> str:
    """One line that says what this run is, and how long it took to get here."""
    cfg, dist_info = run.cfg, run.dist_info
    parameters = sum(p.numel() for p in run.model.parameters())
    blocks = "" if cfg.RELU_AFTER_SUM else ", seed blocks"
    extras = [
        name
        for name, on in (
            ("compiled", cfg.COMPILE),
            ("SyncBatchNorm", cfg.SYNC_BN),
            (f"{cfg.ACCUMULATE} micro-batches", cfg.ACCUMULATE > 1),
            ("bf16 all-reduce", cfg.BF16_ALLREDUCE),
        )
        if on
    ]
    return " | ".join(
        [
            f"ResNet(width={cfg.WIDTH}, {parameters:,} parameters{blocks}) on {cfg.DATASET} "
            f"({len(run.train_data):,} train, {len(run.test_data):,} test images)",
            f"{dist_info.world_size} rank(s) on {dist_info.device.type} ({dist_info.backend})",
            f"global batch {cfg.BATCH_SIZE} ({cfg.BATCH_SIZE // dist_info.world_size} per rank), {run.steps_per_epoch} "
            f"steps per epoch, {cfg.EPOCHS} epochs",
            f"{cfg.OPTIMIZER} peak lr {peak_lr(cfg):.4g}",
            "bf16 autocast" if run.bf16 else "fp32",
            *extras,
            f"start-up {time.time() - run.launched_at:.1f} s",
        ]
    )


# ----------------------------------------------------------------------------- the epoch loop


def train(run: Run, history: list[dict[str, float]]) -> None:
    """The epochs: train, evaluate, report; rank 0 hands the files to a background writer."""
    cfg, is_main = run.cfg, run.dist_info.is_main
    writer = ResultWriter(cfg.OUTPUT_DIR) if is_main else None
    try:
        for epoch in range(len(history) + 1, cfg.EPOCHS + 1):
            started = time.perf_counter()
            (loss_sum, correct, images), train_seconds, lr = train_epoch(run, epoch)
            stop_if_diverged(loss_sum, epoch, cfg)
            test_loss, acc = evaluate(run)
            epoch_seconds, elapsed = time.perf_counter() - started, run.elapsed()
            waited = wait_for_files(writer)  # rank 0: the previous epoch's files are on disk
            history.append(
                {
                    "epoch": epoch,
                    "loss": loss_sum / images,
                    "acc": acc,
                    "test_loss": test_loss,
                    "train_acc": correct / images,
                    "lr": lr,
                    "epoch_seconds": epoch_seconds,
                    "elapsed_seconds": elapsed,
                    "images_per_second": images / train_seconds,
                    "peak_memory_mb": peak_memory_mb(run.dist_info.device),
                    "write_wait_seconds": waited,
                }
            )
            if writer:
                snapshot, ready = checkpoint_snapshot(run, history)
                writer.submit(snapshot, history, ready)
                print(epoch_line(history[-1], cfg.EPOCHS), flush=True)
    finally:
        if writer:
            writer.close()  # every completed epoch's files are on disk before this rank leaves
    if is_main:
        print(summary_line(history, cfg.OUTPUT_DIR), flush=True)


# ----------------------------------------------------------------------------- training


def peak_lr(cfg: SimpleNamespace) -> float:
    """SGD's learning rate grows linearly with the global batch; Adam's is used as given."""
    return cfg.LR * cfg.BATCH_SIZE / LR_REFERENCE_BATCH if cfg.OPTIMIZER == "sgd" else cfg.LR


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
    """One epoch of training steps. Returns the all-ranks sums [loss x images, correct, images],
    this rank's seconds of training (steps only) and the last step's learning rate."""
    cfg, dist_info = run.cfg, run.dist_info
    steps = run.steps_per_epoch
    loss_fn = loss_function(cfg)
    progress = Progress(dist_info.is_main, cfg.PROGRESS_EVERY, epoch, cfg.EPOCHS, steps, dist_info.world_size)
    sums = torch.zeros(3, device=dist_info.device)
    run.ddp_model.train()
    synchronize(dist_info.device)
    started = time.perf_counter()
    lr = 0.0
    batches = run.train_data.train_batches(cfg.BATCH_SIZE, dist_info.world_size, dist_info.rank, cfg.SEED, epoch)
    for step, (x, y) in enumerate(batches):
        lr = lr_at((epoch - 1) * steps + step, cfg.EPOCHS * steps, peak_lr(cfg), cfg.SCHEDULE, cfg.WARMUP)
        train_step(run, x, y, lr, loss_fn, sums)
        progress.update(step, sums)
    synchronize(dist_info.device)
    seconds = time.perf_counter() - started
    progress.clear()
    dist.all_reduce(sums)
    return sums.tolist(), seconds, lr


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, lr: float, loss_fn: nn.Module, sums: torch.Tensor) -> None:
    """One optimizer step on this rank's share of the global batch, in ACCUMULATE micro-batches; DDP
    averages the gradients over the ranks during the last one's backward (no_sync skips the others).
    Adds [loss x images, correct, images] to the device tensor `sums` (no host sync)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    micro_batches = list(zip(x.chunk(run.cfg.ACCUMULATE), y.chunk(run.cfg.ACCUMULATE), strict=True))
    for i, (xs, ys) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with run.autocast(), nullcontext() if last else run.ddp_model.no_sync():
            logits = run.ddp_model(xs)
            loss = loss_fn(logits, ys)
        (loss * (len(ys) / len(y))).backward()  # the mean over this rank's share, as one step would take
        sums[0] += loss.detach().float() * len(ys)
        sums[1] += (logits.argmax(dim=1) == ys).sum()
        sums[2] += len(ys)
    run.optimizer.step()


def stop_if_diverged(loss_sum: float, epoch: int, cfg: SimpleNamespace) -> None:
    """The sums are all-reduced: every rank sees a non-finite loss and stops together."""
    if math.isfinite(loss_sum):
        return
    kept = (
        f"kept the checkpoint of epoch {epoch - 1} in {cfg.OUTPUT_DIR}"
        if epoch > 1
        else "no checkpoint was written (the first epoch diverged)"
    )
    raise UserError(
        f"the training loss became {loss_sum} in epoch {epoch}; stopped every rank and {kept}; "
        f"lower --lr (now {cfg.LR}) and start a new run"
    )


# ----------------------------------------------------------------------------- evaluation and results


def share_batchnorm_statistics(model: nn.Module) -> None:
    """Give every rank rank 0's BatchNorm running statistics: each rank's forward updates its own
    from its own share of the batch, so they differ, and sharded evaluation would mix them."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(run: Run) -> tuple[float, float]:
    """Mean test loss and accuracy over the whole test set, each image exactly once: every rank
    evaluates its own part with the plain network (never the DDP wrapper), then the sums meet."""
    share_batchnorm_statistics(run.model)
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
    dist.all_reduce(sums)
    loss_sum, correct, images = sums.tolist()
    return loss_sum / images, correct / images


def wait_for_files(writer: ResultWriter | None) -> float:
    """Rank 0 waits until the previous epoch's files are on disk (the writer is at most one epoch
    behind); a failed write stops every rank with rank 0's one line. Returns the seconds waited."""
    waited, error = 0.0, None
    if writer:
        try:
            waited = writer.wait()
        except UserError as e:
            error = str(e)
    raise_if_any(error)
    return waited


def checkpoint_snapshot(run: Run, history: list[dict[str, float]]) -> tuple[dict[str, Any], Any]:
    """What the writer saves, copied to the CPU now (training goes on changing the weights); on a GPU
    the copies are queued behind this epoch's kernels and an event marks when they are done."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "epoch": history[-1]["epoch"],
        "steps_per_epoch": run.steps_per_epoch,
        "config": vars(run.cfg),
        "history": history,
        "run_ids": run_ids(),  # a restart continues this checkpoint only if it names the same run
    }
    snapshot = cpu_snapshot(state)
    ready = None
    if run.dist_info.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return snapshot, ready


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of the largest rank: GPU memory allocated, or the process's resident size on CPU."""
    if device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    peak = torch.tensor([mine], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(peak.item(), 1)


# ----------------------------------------------------------------------------- the launcher


def main(argv: list[str]) -> int:
    """Read and check the settings, get the data ready once, then start the ranks."""
    launched_at = process_start_time()
    try:
        cfg = read_config(argv)
        world_size = check_before_start(cfg)
    except UserError as e:
        return refuse_to_start(e)
    return run_distribute(main_worker, world_size, cfg, launched_at)


def check_before_start(cfg: SimpleNamespace) -> int:
    """Every check that needs no worker, and the data made ready once; returns the world size.
    Raises UserError naming the fix. Under torchrun the ranks check the data and OUTPUT_DIR."""
    config.check_limits(cfg, config.read_settings(__file__))
    world_size = resolve_world_size(cfg.WORLD_SIZE)
    if cfg.BATCH_SIZE % (world_size * cfg.ACCUMULATE):
        raise UserError(
            f"BATCH_SIZE={cfg.BATCH_SIZE} does not split evenly over {world_size} ranks x "
            f"{cfg.ACCUMULATE} micro-batches; use a multiple of {world_size * cfg.ACCUMULATE}"
        )
    if under_torchrun():
        return world_size
    check_output_dir(cfg.OUTPUT_DIR)
    if cfg.RESUME and restart_count() == 0:
        read_resume_checkpoint(cfg)
    train_images = data.prepare(cfg.DATASET, cfg.DATA_DIR, cfg.SYNTHETIC_SIZE)  # download, or decode and check
    if train_images < cfg.BATCH_SIZE:
        raise UserError(
            f"the training set has {train_images} images, fewer than one global batch "
            f"(BATCH_SIZE={cfg.BATCH_SIZE}); lower --batch_size"
        )
    return world_size


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
