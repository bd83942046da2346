"""Train the seed's ResNet on CIFAR-10 with DistributedDataParallel (NCCL on GPUs, gloo on CPUs).

    python train_distribute.py                          # every GPU of this machine, or 2 CPU processes
    python train_distribute.py --epochs 5 --width 16    # override any setting below for one run (--help lists them)
    torchrun --standalone --nproc_per_node=4 train_distribute.py

Edit a setting below and rerun. Rank 0 prints one line per epoch and writes OUTPUT_DIR/pytorch_res.csv, pytorch_res.png,
checkpoint.pt and best.pt (the best epoch's). Comments starting "DDP:" mark where ranks meet: every rank must make those
calls. Calls into safeguards/ keep runs safe (resume, one run per folder, files, failures): skip them at first."""

import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import data
import distribute_tools
import muon
from distribute_tools import DistInfo
from resnet import ResNet
from safeguards import failures, files, settings, start
from safeguards.failures import UserError

# ----------------------------------------------------------------------------- settings
DATASET: Literal["cifar10", "imagefolder", "synthetic"] = "cifar10"  # downloaded, your images, or generated
SYNTHETIC_SIZE: int = 10_000  # training images of DATASET="synthetic" (and a fifth as many test images)
IMAGE_SIZE: int = 32  # images of another size are stretched to this square; CIFAR-10 is 32
WIDTH: int = 64  # channels of the first layer: 64 is the seed's network (9.6 M parameters); 8 or 16 for quick runs
# the recipe; the seed's: --optimizer adam --lr 1e-3 --schedule constant --batch_size 256 --epochs 100
# --weight_decay 0 --label_smoothing 0 --augment False --tta False
EPOCHS: int = 30  # passes over the training set
BATCH_SIZE: int = 512  # global batch: images per optimizer step over all ranks together, split evenly between them
OPTIMIZER: Literal["sgd", "adam", "muon"] = "muon"  # muon: Muon on the filters, sgd on the rest; adam: the seed's
LR: float = 0.4  # peak learning rate; sgd, muon: per 512 images (the run uses LR * BATCH_SIZE / 512); adam: as given
SCHEDULE: Literal["onecycle", "cosine", "constant"] = "onecycle"  # warm-up to the peak, then linear or cosine to 0
WARMUP: float = 0.2  # onecycle, cosine: fraction of all steps spent warming up (linearly)
MOMENTUM: float = 0.9  # sgd, muon: Nesterov momentum
WEIGHT_DECAY: float = 5e-4  # L2 penalty, multiplied by the (batch-scaled) LR each step
LABEL_SMOOTHING: float = 0.2  # share of each training target spread evenly over all classes (0: plain cross-entropy)
AUGMENT: bool = True  # random crops (shifts of up to an eighth of the image, reflect padding) and flips, on the device
MUON_SCALE: float = 0.1  # muon: the filters' orthogonalised step, per unit of LR (the run's, batch-scaled)
SEED: int = 0  # model init, data order and augmentation derive from SEED, the epoch and the rank only
HOLDOUT: float = 0.0  # share of each class's training images held out (drawn from SEED) to pick the best epoch: 0.1
INIT_FROM: str = ""  # fine-tune: a checkpoint.pt whose tensors of matching name and shape replace the initial weights
# where and how it runs and reports: a resumed run may change these (the settings above are its checkpoint's)
DATA_DIR: str = "./data"  # CIFAR-10 is downloaded here; imagefolder reads DATA_DIR/train/<class>/ and test/<class>/
OUTPUT_DIR: str = "./output"  # CSV, picture and checkpoint; an earlier run's files there move to previous-<time>/
NUM_WORKERS: int = -1  # image folders: decoding processes per rank; -1: none up to 8 MB, else a rank's cores - 1, min 1
EVAL_EVERY: int = 1  # evaluate every N epochs, and always the last (the CSV's acc and test_loss are NaN between)
TTA: bool = True  # test-time augmentation: average the logits of each test image and its mirror image
PRECISION: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 where fast, fp16 on older GPUs, else fp32
COMPILE: bool = False  # torch.compile the model: faster steps after a minute or more of compiling
ACCUMULATE: int = 1  # micro-batches per step: each rank's share of the batch in this many passes, in less memory
WORLD_SIZE: int = 0  # processes to start: 0 = one per GPU (2 on a machine without GPUs); torchrun decides there
RESUME: bool = False  # continue OUTPUT_DIR's run with its checkpoint's settings (restarts do); --epochs N extends it
TENSORBOARD: bool = False  # also write TensorBoard event files into OUTPUT_DIR (needs the tensorboard package)
COLLECTIVE_TIMEOUT: int = 600  # seconds a rank waits for the others in a collective before the run fails


def make_model(cfg: SimpleNamespace, num_classes: int) -> nn.Module:
    """The network. Swap in yours here: any module that maps a batch of images to logits."""
    return ResNet(cfg.WIDTH, num_classes=num_classes)


# ----------------------------------------------------------------------------- one rank's run
@dataclass
class Run:
    """What one rank trains with. Built once; the epoch loop reads it."""

    cfg: SimpleNamespace
    info: DistInfo
    model: nn.Module  # the plain network: evaluation and checkpoints use it
    ddp_model: nn.Module  # the network and its loss (WithLoss), in DDP on several ranks, compiled with COMPILE
    optimizer: torch.optim.Optimizer
    train_data: data.Loader
    eval_data: dict[str, data.Loader]  # "val" (HOLDOUT's images), "test": each split that evaluation reports
    data: dict[str, Any]  # what the checkpoint records of the data: identity, classes, normalisation
    precision: str  # the first line's words on it, first "bf16", "fp16" (its loss scaled by `scaler`) or "fp32"
    scaler: torch.amp.GradScaler  # fp16's dynamic loss scaling (a step whose gradients overflow is skipped); else off
    step_sums: dict = field(default_factory=lambda: defaultdict(float))  # train_step's values: CSV columns, per step


class WithLoss(nn.Module):
    """The network and the loss of its logits: the module that a training step calls, DDP wraps and COMPILE compiles."""

    def __init__(self, network: nn.Module, loss_fn: nn.Module) -> None:
        super().__init__()
        self.network, self.loss_fn = network, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.network(x)
        return logits, self.loss_fn(logits, y)


def main_worker(cfg: SimpleNamespace) -> None:
    """Everything one rank does, from joining the group to leaving it."""
    info = distribute_tools.setup(cfg.COLLECTIVE_TIMEOUT)  # DDP: join the group
    # DDP: new, resumed or finished, decided alike on every rank; a resume goes on with the checkpoint's settings
    kind, checkpoint, cfg = start.all_ranks_begin(cfg, info)
    if kind != "finished":
        data.prepare(cfg)  # CIFAR-10 downloaded once per machine (a file lock); under the launcher, there already
        train(build_run(cfg, info), checkpoint)
    distribute_tools.cleanup()  # DDP: every rank meets, then leaves


def build_run(cfg: SimpleNamespace, info: DistInfo) -> Run:
    """Data on the device, the network wrapped in DDP, the optimizer."""
    train_data, eval_data, record = data.load(cfg, info, torch.channels_last)  # DDP: ranks pool unreadable images
    torch.backends.cudnn.benchmark = info.device.type == "cuda"  # fixed shapes: pick the fastest convolution once
    torch.manual_seed(cfg.SEED)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = make_model(cfg, len(record["classes"]))
    model = model.to(info.device, memory_format=torch.channels_last)  # what tensor cores want; faster on CPUs too
    device_ids = [info.device.index] if info.device.type == "cuda" else None  # on GPUs, this rank's own
    ddp_model: nn.Module = WithLoss(model, nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING))
    if info.world_size > 1:  # DDP: wrap the model; gradients are all-reduced in buckets (alone, DDP only copies them)
        options = {"gradient_as_bucket_view": True, **distribute_tools.NO_BUFFER_SYNC}
        ddp_model = DistributedDataParallel(ddp_model, device_ids, **options)
    ddp_model = failures.quiet_compile(ddp_model) if cfg.COMPILE else ddp_model  # torch.compile, loss in the graph
    precision = start.precision(info.device, cfg.PRECISION, model, cfg.IMAGE_SIZE)  # auto: what this device does fast
    scaler = torch.amp.GradScaler(info.device.type, enabled=precision.startswith("fp16"))  # fp16's range: scaled
    optimizer = muon.make_optimizer(cfg, model, peak_lr(cfg), info.device, precision.startswith("bf16"))  # muon.py
    return Run(cfg, info, model, ddp_model, optimizer, train_data, eval_data, record, precision, scaler)


# ----------------------------------------------------------------------------- the epoch loop
def train(run: Run, checkpoint: dict[str, Any] | None) -> None:
    """The epochs: train, evaluate, report; rank 0 hands each epoch's files to a background writer."""
    cfg, info, started = run.cfg, run.info, time.perf_counter()
    # a resume: the checkpoint's weights, optimizer, rows, once its data and network are checked (a refusal is the only
    # line); a new run with INIT_FROM: the weights that fit. DDP: with INIT_FROM every rank meets (a failure stops all)
    history = start.restore(checkpoint, run.model, run.optimizer, run.scaler, run.data["identity"], cfg)
    if info.is_main:  # rank 0 alone prints and writes files
        steps = run.train_data.steps_per_epoch(cfg.BATCH_SIZE)
        print(files.describe(run.model, cfg, info, run.data, steps, run.precision))
    # the files of each epoch (and TensorBoard's, which a resume continues from its first epoch), in the background
    writer = files.ResultWriter(cfg.OUTPUT_DIR, cfg.TENSORBOARD, len(history) + 1) if info.is_main else None
    earlier_seconds = history[-1]["elapsed_seconds"] if history else 0.0  # a resumed run's clock goes on
    try:
        for epoch in range(len(history) + 1, cfg.EPOCHS + 1):
            epoch_started = time.perf_counter()
            (loss_sum, correct, images), train_seconds, lr, step_means = train_epoch(run, epoch)
            due = epoch % cfg.EVAL_EVERY == 0 or epoch == cfg.EPOCHS  # the last: its acc is the final checkpoint's
            scores = evaluate(run, due)  # DDP: every rank alike (when due)
            epoch_seconds = time.perf_counter() - epoch_started
            # DDP: every rank; rank 0 waits for the previous epoch's files (a failed write stops every rank). From the
            # meeting on a stop waits while rank 0 hands this epoch's files over: every rank names the same kept epoch
            waited = failures.all_ranks_try(writer.wait if writer else None, hold_stops=True) or 0.0
            row = {  # one CSV column per key, in this order
                "epoch": epoch,
                "loss": loss_sum / images,  # mean training loss over every image of the epoch on all ranks
                **scores,  # acc and test_loss (every test image exactly once); val_acc and val_loss with HOLDOUT
                "train_acc": correct / images,
                **step_means,  # each value train_step adds to run.step_sums, averaged over the epoch's steps and ranks
                "lr": lr,  # at the epoch's last step
                "epoch_seconds": epoch_seconds,  # this epoch's training steps and evaluation
                "elapsed_seconds": earlier_seconds + time.perf_counter() - started,
                "images_per_second": images / train_seconds,  # all ranks' training images per second of steps
                "peak_memory_mb": files.peak_memory_mb(info.device),  # rank 0's (the ranks do the same work)
                "write_wait_seconds": waited,  # how long training waited for the previous epoch's files
            }
            history.append(row)
            if writer:  # checkpoint.pt: weights (no DDP prefixes), optimizer, rows, what resume and predict.py need
                state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "history": history}
                state |= {"epoch": epoch, "config": vars(cfg), "data": run.data, "precision": run.precision}
                state |= {"ranks": info.world_size, "scaler": run.scaler.state_dict()}  # fp16's loss scale goes on too
                writer.submit(state, history)
                shown = "  ".join(f"{key} {row[key]:.4f}" for key in ("loss", *scores)) + f"  lr {lr:.4g}"
                speed = f"{epoch_seconds:.1f} s  {row['images_per_second']:,.0f} img/s"
                print(f"epoch {epoch}/{cfg.EPOCHS}  {shown}  {speed}", flush=True)  # the epoch's line
            failures.stops_go_on()  # a stop held since the meeting ends the rank now
    finally:
        if writer:
            writer.close()  # every completed epoch's files are on disk before this rank leaves
    failures.ignore_stop_signals()  # the run is complete: a stop signal now changes nothing
    if writer:
        print(files.summary_line(history, cfg.OUTPUT_DIR), flush=True)


# ----------------------------------------------------------------------------- training
def peak_lr(cfg: SimpleNamespace) -> float:
    """SGD's and Muon's learning rate grows with the global batch (LR is per 512 images); Adam's is used as given."""
    return cfg.LR * cfg.BATCH_SIZE / 512 if cfg.OPTIMIZER != "adam" else cfg.LR


def lr_at(step: int, total_steps: int, peak: float, schedule: str, warmup: float) -> float:
    """The learning rate of optimizer step `step` (0-based) out of `total_steps`."""
    if schedule == "constant":
        return peak
    warmup_steps = max(1, round(warmup * total_steps))
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    left = (total_steps - step) / max(1, total_steps - warmup_steps)  # 1 at the peak, 0 after the last step
    return peak * (left if schedule == "onecycle" else (1 - math.cos(math.pi * left)) / 2)  # cosine: a half wave


def train_epoch(run: Run, epoch: int) -> tuple[list[float], float, float, dict[str, float]]:
    """One epoch of training steps: the all-ranks sums [loss x images, correct, images], this rank's seconds of
    training steps, the last step's learning rate, the means of run.step_sums over the steps of every rank."""
    cfg, info = run.cfg, run.info
    steps = run.train_data.steps_per_epoch(cfg.BATCH_SIZE)
    sums = torch.zeros(3, device=info.device)  # on the device: no host sync per step
    run.step_sums.clear()
    run.ddp_model.train()
    torch.cuda.synchronize() if info.device.type == "cuda" else None  # the clock starts with nothing queued
    started, lr = time.perf_counter(), 0.0
    # this rank's part of the epoch's one order. DDP: streamed, the ranks meet as the pass ends: each runs it to the end
    batches = run.train_data.train_batches(cfg.BATCH_SIZE, info.world_size, info.rank, cfg.SEED, epoch)
    batches = files.progress(batches, steps, epoch, cfg) if info.is_main else batches  # a bar on a terminal
    for step, (x, y) in enumerate(batches):
        torch.manual_seed(data.seed_for(cfg.SEED, epoch, info.rank, step))  # the network's dropout: resumes exactly
        lr = lr_at((epoch - 1) * steps + step, cfg.EPOCHS * steps, peak_lr(cfg), cfg.SCHEDULE, cfg.WARMUP)
        train_step(run, x, y, lr, sums)
    torch.cuda.synchronize() if info.device.type == "cuda" else None  # and stops when the steps are done
    seconds = time.perf_counter() - started
    sums = torch.cat([sums, *(value.reshape(1).float() for value in run.step_sums.values())])  # every rank's alike
    dist.all_reduce(sums)  # DDP: the epoch's sums over all ranks, once
    loss_sum, correct, images, *step_sums = sums.tolist()
    if not math.isfinite(loss_sum):  # every rank sees the same sums: all stop, the last good checkpoint stays
        raise UserError(f"the training loss became {loss_sum} in epoch {epoch}; lower --lr ({cfg.LR}); {failures.KEPT}")
    means = {name: total / (steps * info.world_size) for name, total in zip(run.step_sums, step_sums, strict=True)}
    return [loss_sum, correct, images], seconds, lr, means


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, lr: float, sums: torch.Tensor) -> None:
    """One optimizer step on this rank's share of the batch, in ACCUMULATE micro-batches (less memory; BatchNorm sees
    each alone). Adds [loss x images, correct, images] to the device tensor `sums` (no host sync)."""
    for group in run.optimizer.param_groups:  # Muon's LR is a device tensor, filled in place (safe in a CUDA graph)
        group["lr"].fill_(lr) if torch.is_tensor(group["lr"]) else group.update(lr=lr)
    run.optimizer.zero_grad(set_to_none=True)
    micro_batches = list(zip(x.chunk(run.cfg.ACCUMULATE), y.chunk(run.cfg.ACCUMULATE), strict=True))
    with autocast(run.info.device, run.precision):  # weights cast once a step
        for i, (x_part, y_part) in enumerate(micro_batches):
            # DDP: gradients are averaged over the ranks during the last micro-batch's backward, bucket by bucket
            with run.ddp_model.no_sync() if run.info.world_size > 1 and i < len(micro_batches) - 1 else nullcontext():
                logits, loss = run.ddp_model(x_part, y_part)
                with torch.autocast(run.info.device.type, enabled=False):  # backward outside autocast, as advised
                    run.scaler.scale(loss * (len(y_part) / len(y))).backward()  # adds up to the share's mean's
            sums[0].add_(loss.detach(), alpha=len(y_part))  # in place: a launch each (+= on an element is two)
            sums[1].add_((logits.argmax(dim=1) == y_part).sum())
            sums[2].add_(len(y_part))
    # a value of this step as a CSV column (its epoch's mean): run.step_sums["name"] += a device tensor (README)
    # DDP: Muon's step all-reduces the filters' updates (each rank computes its share). fp16: a step whose gradients
    # overflowed is skipped (one host sync a step), on every rank alike: the gradients were averaged over all of them
    run.scaler.step(run.optimizer)
    run.scaler.update()


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(run: Run, due: bool = True) -> dict[str, float]:
    """Accuracy and mean loss of each evaluation split, each image exactly once (NaN where not `due`): every rank
    evaluates its own part with the plain network (never the DDP wrapper), then the sums meet."""
    names = [n for s in run.eval_data for n in (("acc", "test_loss") if s == "test" else ("val_acc", "val_loss"))]
    if not due:
        return dict.fromkeys(names, math.nan)
    for buffer in run.model.buffers():  # DDP: every rank evaluates with rank 0's BatchNorm statistics
        dist.broadcast(buffer, src=0)
    run.model.eval()
    sums = torch.zeros(len(run.eval_data), 3, device=run.info.device)
    for split, loader in enumerate(run.eval_data.values()):
        for x, y in loader.eval_batches(run.info.world_size, run.info.rank):  # DDP: streamed, the ranks meet at the end
            with autocast(run.info.device, run.precision):
                logits = eval_logits(run.model, x, run.cfg.TTA)
            sums[split, 0] += F.cross_entropy(logits, y, reduction="sum")
            sums[split, 1] += (logits.argmax(dim=1) == y).sum()
            sums[split, 2] += len(y)
    run.model.train()
    dist.all_reduce(sums)  # DDP: every split's sums over all ranks, at once
    scores = [value for loss, correct, images in sums.tolist() for value in (correct / images, loss / images)]
    return dict(zip(names, scores, strict=True))  # acc, test_loss; val_acc, val_loss


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The forward pass in the run's precision (its first word): bf16 or fp16 autocast, or none for fp32."""
    dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=not precision.startswith("fp32"))


def eval_logits(model: nn.Module, x: torch.Tensor, tta: bool) -> torch.Tensor:
    """The logits that evaluation (and predict.py) use: with TTA, the mean of the image's and its mirror image's."""
    logits = model(x).float()
    return (logits + model(x.flip(3)).float()) / 2 if tta else logits  # averaged in fp32, not bf16


# ----------------------------------------------------------------------------- the launcher
def main(argv: list[str], entrypoint: Callable | str = sys.executable) -> int:
    """`python train_distribute.py`: check the settings, get the data once, start the ranks; the run's exit code. A
    rank (started by torchrun, or by this launcher through torch's elastic agent) runs main_worker."""
    if distribute_tools.under_torchrun():
        return failures.run_rank(lambda: main_worker(settings.check(settings.read(sys.modules[__name__], argv))))
    return failures.run_launcher(lambda: launch(argv, entrypoint))


def launch(argv: list[str], entrypoint: Callable | str) -> None:
    """The launcher: the checks, the start rule on this machine's OUTPUT_DIR, the data made ready once, the ranks."""
    cfg = settings.check(settings.read(sys.modules[__name__], argv))
    kind, _, cfg = start.begin(cfg, start.restarted_by())  # a resume goes on with the checkpoint's settings
    if kind == "finished":  # a resume of a complete run has nothing to do
        return
    data.prepare(cfg)  # download CIFAR-10 once, for every rank
    args = ("-u", __file__, *argv) if isinstance(entrypoint, str) else (argv,)  # a program, or a function of argv
    world_size = distribute_tools.world_size(cfg.WORLD_SIZE)  # 0: one per GPU, or 2 on a machine without GPUs
    distribute_tools.run_distribute(entrypoint, world_size, *args)  # a process per rank


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
