"""Train the seed's ResNet on CIFAR-10 with DistributedDataParallel (NCCL on GPUs, gloo on CPUs).

    python train_distribute.py                        # every GPU of this machine, or 2 CPU processes
    python train_distribute.py --width=16 --epochs=5  # any constant below, as --lower_case_name=value
    torchrun --standalone --nproc_per_node=4 train_distribute.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 train_distribute.py

Edit a constant and rerun: that is the main way to configure a run. Rank 0 prints one line per
epoch and writes OUTPUT_DIR/pytorch_res.csv, pytorch_res.png and checkpoint.pt after every epoch.
"""
import math
import os
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# ----------------------------------------------------------------------------- constants
# data
DATASET = "cifar10"  # "cifar10" (downloaded into DATA_DIR), "imagefolder" (DATA_DIR/train and DATA_DIR/test) or "synthetic"
DATA_DIR = "./data"  # where the dataset is, or where CIFAR-10 is downloaded to
SYNTHETIC_SIZE = 10_000  # training images of DATASET="synthetic" (and a fifth as many test images)
OUTPUT_DIR = "./output"  # CSV, picture and checkpoint; an earlier run's files there move to previous-<time>/
# model
WIDTH = 64  # channels of the first layer: 64 is the seed's network (9.6 M parameters); 16 or 8 for quick CPU runs
RELU_AFTER_SUM = True  # ReLU on each residual block's sum, as standard ResNets do; False: the seed's block exactly
# recipe (defaults: the fast one; the seed's: OPTIMIZER="adam" LR=1e-3 SCHEDULE="constant" BATCH_SIZE=256 EPOCHS=100
#         WEIGHT_DECAY=0 LABEL_SMOOTHING=0 AUGMENT=False TTA=False RELU_AFTER_SUM=False)
EPOCHS = 30  # passes over the training set
BATCH_SIZE = 512  # global batch: images per optimizer step over all ranks together, split evenly between them
OPTIMIZER = "sgd"  # "sgd" (Nesterov momentum) or "adam"
LR = 0.4  # peak learning rate; sgd: per 512 images of BATCH_SIZE (the run uses LR * BATCH_SIZE / 512); adam: as given
SCHEDULE = "onecycle"  # "onecycle": per step, linear warm-up from 0 to the peak, then linear decay to 0; "constant"
WARMUP = 0.2  # onecycle: fraction of all steps spent warming up
MOMENTUM = 0.9  # sgd: Nesterov momentum
WEIGHT_DECAY = 5e-4  # L2 penalty; multiplied by the (batch-scaled) LR each step, so the decay per epoch is batch-independent
LABEL_SMOOTHING = 0.2  # share of each training target spread evenly over all classes (0: plain cross-entropy)
AUGMENT = True  # random crops (shifts of up to 4 px, reflect padding) and horizontal flips, on the device
TTA = True  # test-time augmentation: average the logits of each test image and its mirror image
# speed
AMP = True  # bf16 autocast on GPUs and on CPUs with native bf16 (fp32 elsewhere, or when False)
COMPILE = False  # torch.compile the model: faster steps after a minute or more of compiling; pays off on long runs
# processes
WORLD_SIZE = 0  # processes to spawn: 0 = one per GPU (2 on a machine without GPUs); under torchrun, torchrun decides
SEED = 0  # model init, data order and augmentation derive from SEED, the epoch and the rank only
RESUME = False  # continue the run in OUTPUT_DIR from its checkpoint.pt (needs the same recipe constants)
COLLECTIVE_TIMEOUT = 600  # seconds a rank waits for the others in a collective before the run fails instead of hanging
PROGRESS_EVERY = 20  # steps between progress-bar refreshes on a terminal (one host sync each)

CONSTANTS = {name: value for name, value in dict(globals()).items()
             if name.isupper() and isinstance(value, (bool, int, float, str))}

# The project's modules come after the constants so that the block above stays the first thing to read.
from data import DATASETS, DeviceLoader, count_training_images, download_cifar10, load_dataset  # noqa: E402
from distribute_tools import (  # noqa: E402
    Dist, UserError, bf16_is_fast, process_group, raise_if_any, resolve_world_size, run_distribute, under_torchrun,
)
from outputs import (  # noqa: E402
    CHECKPOINT_NAME, Progress, epoch_line, load_checkpoint, move_aside_earlier_results, plot_history,
    remove_stale_temporaries, save_checkpoint, summary_line, write_csv,
)
from resnet import ResNet  # noqa: E402

# Constants a resumed run must share with its checkpoint: they shape the run itself.
RUN_SHAPING = ("DATASET", "SYNTHETIC_SIZE", "WIDTH", "RELU_AFTER_SUM", "EPOCHS", "BATCH_SIZE", "OPTIMIZER", "LR",
               "SCHEDULE", "WARMUP", "MOMENTUM", "WEIGHT_DECAY", "LABEL_SMOOTHING", "AUGMENT", "SEED")
LR_REFERENCE_BATCH = 512  # sgd's LR is stated per this many images


# ----------------------------------------------------------------------------- configuration


def read_config(argv: list[str]) -> SimpleNamespace:
    """The constants above, with `--name=value` overrides applied and type-checked."""
    values = dict(CONSTANTS)
    for arg in argv:
        name, equals, text = arg[2:].partition("=")
        if not arg.startswith("--") or not equals:
            raise UserError(f"cannot read argument {arg!r}; write overrides as --name=value, e.g. --epochs=5")
        key = name.upper()
        if key not in CONSTANTS:
            raise UserError(f"unknown setting --{name}; the settings are the constants at the top of "
                            f"train_distribute.py in lower case, e.g. --epochs=5")
        values[key] = parse_value(name, text, CONSTANTS[key])
    return SimpleNamespace(**values)


def parse_value(name: str, text: str, default: Any) -> Any:
    kind = type(default)
    try:
        if kind is bool:
            return {"true": True, "false": False}[text.lower()]
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        return text
    except (KeyError, ValueError):
        wanted = {bool: "True or False", int: "an integer", float: "a number"}[kind]
        raise UserError(f"--{name}={text} is not {wanted}; e.g. --{name}={default}") from None


def validate(cfg: SimpleNamespace) -> int:
    """Every check that needs no worker; returns the world size. Raises UserError naming the fix."""
    positive = {"EPOCHS": cfg.EPOCHS, "BATCH_SIZE": cfg.BATCH_SIZE, "WIDTH": cfg.WIDTH,
                "SYNTHETIC_SIZE": cfg.SYNTHETIC_SIZE, "COLLECTIVE_TIMEOUT": cfg.COLLECTIVE_TIMEOUT,
                "PROGRESS_EVERY": cfg.PROGRESS_EVERY}
    for name, value in positive.items():
        if value <= 0:
            raise UserError(f"{name}={value} must be positive; e.g. --{name.lower()}={CONSTANTS[name]}")
    if not (math.isfinite(cfg.LR) and cfg.LR > 0):
        raise UserError(f"LR={cfg.LR} must be a positive number; e.g. --lr={LR}")
    choices = {"DATASET": DATASETS, "OPTIMIZER": ("sgd", "adam"), "SCHEDULE": ("onecycle", "constant")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise UserError(f"{name}={getattr(cfg, name)!r} is unknown; use one of {', '.join(allowed)}")
    fractions = {"WARMUP": (cfg.WARMUP, 0, 1), "LABEL_SMOOTHING": (cfg.LABEL_SMOOTHING, 0, 0.99),
                 "MOMENTUM": (cfg.MOMENTUM, 0.01, 0.999), "WEIGHT_DECAY": (cfg.WEIGHT_DECAY, 0, 1)}
    for name, (value, low, high) in fractions.items():
        if not low <= value <= high:
            raise UserError(f"{name}={value} is outside {low}..{high}; e.g. --{name.lower()}={CONSTANTS[name]}")
    world_size = resolve_world_size(cfg.WORLD_SIZE)
    if cfg.BATCH_SIZE % world_size:
        raise UserError(f"BATCH_SIZE={cfg.BATCH_SIZE} does not split evenly over {world_size} ranks; "
                        f"use a multiple of {world_size}")
    train_images = count_training_images(cfg.DATASET, cfg.DATA_DIR, cfg.SYNTHETIC_SIZE)
    if train_images < cfg.BATCH_SIZE:
        raise UserError(f"the training set has {train_images} images, fewer than one global batch "
                        f"(BATCH_SIZE={cfg.BATCH_SIZE}); lower BATCH_SIZE")
    if cfg.RESUME and not under_torchrun():  # under torchrun only global rank 0 may hold the checkpoint
        read_resume_checkpoint(cfg)
    return world_size


def read_resume_checkpoint(cfg: SimpleNamespace) -> dict[str, Any]:
    """The checkpoint to resume from, once it is known to continue this same run."""
    path = os.path.join(cfg.OUTPUT_DIR, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise UserError(f"RESUME=True but there is no {path}; run without --resume=True to start a new run, "
                        f"or set --output_dir to the run to continue")
    try:
        checkpoint = load_checkpoint(cfg.OUTPUT_DIR)
    except Exception as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}); start a new run without --resume=True") from None
    for name in RUN_SHAPING:
        saved = checkpoint["config"].get(name)
        if saved != getattr(cfg, name):
            raise UserError(f"RESUME=True but {name}={getattr(cfg, name)!r} differs from the checkpoint's "
                            f"{saved!r}; resume with --{name.lower()}={saved}, or start a new run")
    return checkpoint


# ----------------------------------------------------------------------------- recipe


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


def make_optimizer(cfg: SimpleNamespace, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere."""
    kind = torch.optim.Adam if cfg.OPTIMIZER == "adam" else torch.optim.SGD
    options: dict[str, Any] = {"lr": peak_lr(cfg), "weight_decay": cfg.WEIGHT_DECAY}
    if kind is torch.optim.SGD:
        options.update(momentum=cfg.MOMENTUM, nesterov=True)
    fused_ok = device.type == "cuda" and "fused" in kind.__init__.__code__.co_varnames
    options["fused" if fused_ok else "foreach"] = True
    return kind(model.parameters(), **options)


# ----------------------------------------------------------------------------- training and evaluation


@dataclass
class Training:
    cfg: SimpleNamespace
    d: Dist
    model: nn.Module  # the plain network: evaluation and checkpoints use it
    step_model: nn.Module  # the same network wrapped in DDP (and compiled if COMPILE): training steps use it
    optimizer: torch.optim.Optimizer
    train_data: DeviceLoader
    test_data: DeviceLoader
    bf16: bool

    @property
    def steps_per_epoch(self) -> int:
        return self.train_data.steps_per_epoch(self.cfg.BATCH_SIZE)

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.d.device.type, dtype=torch.bfloat16, enabled=self.bf16)


def train_step(t: Training, x: torch.Tensor, y: torch.Tensor, lr: float, loss_fn: nn.Module
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's part of the global batch; DDP averages the gradients.
    Returns the batch's mean loss and correct count as device tensors (no host sync)."""
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    with t.autocast():
        logits = t.step_model(x)
        loss = loss_fn(logits, y)
    t.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    t.optimizer.step()
    return loss.detach(), (logits.argmax(dim=1) == y).sum()


def loss_function(cfg: SimpleNamespace) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=cfg.LABEL_SMOOTHING)


def train_epoch(t: Training, epoch: int, progress: Progress) -> tuple[list[float], float, float]:
    """One epoch of training steps. Returns the all-ranks sums [loss x images, correct, images],
    this rank's seconds of training (steps only) and the last step's learning rate."""
    cfg, d = t.cfg, t.d
    loss_fn = loss_function(cfg)
    total_steps = cfg.EPOCHS * t.steps_per_epoch
    first_step = (epoch - 1) * t.steps_per_epoch
    sums = torch.zeros(3, device=d.device)
    t.step_model.train()
    progress.start(epoch, cfg.EPOCHS, t.steps_per_epoch, d.world_size)
    synchronize(d.device)
    started = time.perf_counter()
    lr = 0.0
    batches = t.train_data.train_batches(cfg.BATCH_SIZE, d.world_size, d.rank, cfg.SEED, epoch)
    for step, (x, y) in enumerate(batches):
        lr = lr_at(first_step + step, total_steps, peak_lr(cfg), cfg.SCHEDULE, cfg.WARMUP)
        loss, correct = train_step(t, x, y, lr, loss_fn)
        sums[0] += loss.float() * len(y)
        sums[1] += correct
        sums[2] += len(y)
        if progress.due(step):
            progress.show(step, sums)
    synchronize(d.device)
    seconds = time.perf_counter() - started
    progress.clear()
    dist.all_reduce(sums)
    return sums.tolist(), seconds, lr


def share_batchnorm_statistics(model: nn.Module) -> None:
    """Give every rank rank 0's BatchNorm running statistics. DDP broadcasts rank 0's at the start of
    each training forward, but the forward then updates each rank's from its own batch: after the
    last step they differ, and sharded evaluation would mix them."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(t: Training) -> tuple[float, float]:
    """Mean test loss and accuracy over the whole test set, each image exactly once: every rank
    evaluates its own part with the plain network (never the DDP wrapper), then the sums meet."""
    share_batchnorm_statistics(t.model)
    t.model.eval()
    sums = torch.zeros(3, device=t.d.device)
    for x, y in t.test_data.eval_batches(t.d.world_size, t.d.rank):
        with t.autocast():
            logits = t.model(x)
            if t.cfg.TTA:
                logits = (logits + t.model(x.flip(3))) / 2
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums[1] += (logits.argmax(dim=1) == y).sum()
        sums[2] += len(y)
    t.model.train()
    dist.all_reduce(sums)
    loss_sum, correct, images = sums.tolist()
    return loss_sum / images, correct / images


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


# ----------------------------------------------------------------------------- the worker


def main_worker(rank: int, world_size: int, cfg: SimpleNamespace) -> None:
    """Everything one rank does, from joining the group to leaving it."""
    with process_group(rank, world_size, cfg.COLLECTIVE_TIMEOUT) as d:
        train(cfg, d)


def train(cfg: SimpleNamespace, d: Dist) -> None:
    """Data and model, a new start or a resumed one, then the epochs; rank 0 reports and writes."""
    if under_torchrun():
        fetch_dataset_per_machine(cfg, d)
        if d.is_main and cfg.WORLD_SIZE not in (0, d.world_size):
            print(f"warning: WORLD_SIZE={cfg.WORLD_SIZE} is ignored under torchrun, which started {d.world_size} ranks")
    t = build_training(cfg, d)
    history = start_or_resume(t)
    started = time.perf_counter()
    progress = Progress(enabled=d.is_main, every=cfg.PROGRESS_EVERY)
    for epoch in range(len(history) + 1, cfg.EPOCHS + 1):
        history.append(run_epoch(t, epoch, progress))
        if d.is_main:
            save_results(t, history)
            print(epoch_line(history[-1], cfg.EPOCHS), flush=True)
    if d.is_main:
        print(summary_line(history, time.perf_counter() - started, cfg.OUTPUT_DIR), flush=True)


def start_or_resume(t: Training) -> list[dict[str, float]]:
    """The epochs already done: none for a new run (an earlier run's files move aside), the
    checkpoint's for a resumed one (the CSV is rewritten from them: rows written after the
    checkpoint, if any, belong to an epoch that runs again)."""
    cfg, d = t.cfg, t.d
    checkpoint = shared_checkpoint(cfg, d)
    history = restore(t, checkpoint) if checkpoint is not None else []
    if d.is_main:
        moved = move_aside_earlier_results(cfg.OUTPUT_DIR) if checkpoint is None else None
        if moved:
            print(f"moved the earlier run's results in {cfg.OUTPUT_DIR} to {moved}")
        remove_stale_temporaries(cfg.OUTPUT_DIR)
        print(describe(t))
        if history:
            write_csv(history, cfg.OUTPUT_DIR)
    return history


def fetch_dataset_per_machine(cfg: SimpleNamespace, d: Dist) -> None:
    """Under torchrun: global rank 0 downloads first, then local rank 0 of every other machine (a
    no-op where DATA_DIR is a shared file system); the others wait. A failure stops all ranks."""
    if cfg.DATASET != "cifar10":
        return
    for my_turn in (d.is_main, d.local_rank == 0 and not d.is_main):
        error = None
        if my_turn:
            try:
                download_cifar10(cfg.DATA_DIR)
            except UserError as e:
                error = str(e)
        raise_if_any(error)


def build_training(cfg: SimpleNamespace, d: Dist) -> Training:
    train_set, test_set = load_dataset(cfg.DATASET, cfg.DATA_DIR, cfg.SYNTHETIC_SIZE, cfg.SEED)
    if d.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest convolution once
    torch.manual_seed(cfg.SEED)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = ResNet(cfg.WIDTH, num_classes=len(train_set.classes), relu_after_sum=cfg.RELU_AFTER_SUM)
    model = model.to(d.device, memory_format=torch.channels_last)
    device_ids = [d.device.index] if d.device.type == "cuda" else None
    step_model: nn.Module = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False,
                                                    gradient_as_bucket_view=True)
    if cfg.COMPILE:
        step_model = torch.compile(step_model)  # after wrapping, so DDP's bucketed all-reduce keeps overlapping
    return Training(cfg, d, model, step_model, make_optimizer(cfg, model, d.device),
                    DeviceLoader(train_set, d.device, augment=cfg.AUGMENT), DeviceLoader(test_set, d.device),
                    bf16=cfg.AMP and bf16_is_fast(d.device))


def shared_checkpoint(cfg: SimpleNamespace, d: Dist) -> Optional[dict[str, Any]]:
    """With RESUME, global rank 0 reads the checkpoint and every rank receives it (other machines'
    OUTPUT_DIR may be empty). A missing or mismatched checkpoint stops every rank."""
    if not cfg.RESUME:
        return None
    box: list[Any] = [None, None]  # checkpoint, error
    if d.is_main:
        try:
            box[0] = read_resume_checkpoint(cfg)
        except UserError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise UserError(box[1])
    return box[0]


def restore(t: Training, checkpoint: dict[str, Any]) -> list[dict[str, float]]:
    """Load weights and optimizer state; returns the epochs already done (the CSV's rows)."""
    if checkpoint["steps_per_epoch"] != t.steps_per_epoch:  # the same constants, but other data
        raise UserError(f"RESUME=True but an epoch now has {t.steps_per_epoch} steps, the checkpoint's "
                        f"{checkpoint['steps_per_epoch']}: the training set changed; resume on the same data")
    t.model.load_state_dict(checkpoint["model"])
    optimizer_state = checkpoint["optimizer"]
    for saved, current in zip(optimizer_state["param_groups"], t.optimizer.param_groups):
        for key in ("fused", "foreach"):  # this machine's kernels, not the saving machine's
            saved[key] = current.get(key)
    t.optimizer.load_state_dict(optimizer_state)
    return list(checkpoint["history"])


def describe(t: Training) -> str:
    """One line that says what this run is."""
    cfg, d = t.cfg, t.d
    parameters = sum(p.numel() for p in t.model.parameters())
    blocks = "" if cfg.RELU_AFTER_SUM else ", seed blocks"
    return " | ".join([
        f"ResNet(width={cfg.WIDTH}, {parameters:,} parameters{blocks}) on {cfg.DATASET} "
        f"({len(t.train_data):,} train, {len(t.test_data):,} test images)",
        f"{d.world_size} rank(s) on {d.device.type} ({d.backend})",
        f"global batch {cfg.BATCH_SIZE} ({cfg.BATCH_SIZE // d.world_size} per rank), {t.steps_per_epoch} steps per "
        f"epoch, {cfg.EPOCHS} epochs",
        f"{cfg.OPTIMIZER} peak lr {peak_lr(cfg):.4g}",
        "bf16 autocast" if t.bf16 else "fp32",
        *(["compiled"] if cfg.COMPILE else []),
    ])


def run_epoch(t: Training, epoch: int, progress: Progress) -> dict[str, float]:
    """Train one epoch, evaluate, and return the CSV row. Every rank gets the same row."""
    started = time.perf_counter()
    (loss_sum, correct, images), train_seconds, lr = train_epoch(t, epoch, progress)
    if not math.isfinite(loss_sum):  # the sums are all-reduced: every rank sees this and stops together
        raise UserError(f"the training loss became {loss_sum} in epoch {epoch}; stopped every rank and kept the "
                        f"checkpoint of epoch {epoch - 1} in {t.cfg.OUTPUT_DIR}; lower LR (now {t.cfg.LR}) "
                        f"and start a new run")
    test_loss, acc = evaluate(t)
    return {"epoch": epoch, "loss": loss_sum / images, "acc": acc, "test_loss": test_loss,
            "train_acc": correct / images, "lr": lr, "epoch_seconds": time.perf_counter() - started,
            "images_per_second": images / train_seconds, "peak_memory_mb": peak_memory_mb(t.d.device)}


def save_results(t: Training, history: list[dict[str, float]]) -> None:
    """Checkpoint first, then the CSV and picture: each is whole at every moment, and the CSV can
    always be rebuilt from the checkpoint's history."""
    state = {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "epoch": history[-1]["epoch"],
             "steps_per_epoch": t.steps_per_epoch, "config": vars(t.cfg), "history": history}
    save_checkpoint(state, t.cfg.OUTPUT_DIR)
    write_csv(history, t.cfg.OUTPUT_DIR)
    plot_history(history, t.cfg.OUTPUT_DIR)


# ----------------------------------------------------------------------------- the launcher


def main(argv: list[str]) -> int:
    """Read and check the settings, fetch the data once, then start the ranks."""
    try:
        cfg = read_config(argv)
        world_size = validate(cfg)
        if cfg.DATASET == "cifar10" and not under_torchrun():
            download_cifar10(cfg.DATA_DIR)  # once, before any rank starts
    except UserError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun: once per machine
            print(f"error: {e}", file=sys.stderr)
        return 2
    return run_distribute(main_worker, world_size, cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
