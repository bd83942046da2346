"""What a run leaves in OUTPUT_DIR and shows on the console; only global rank 0 writes and prints.

Every file is written to a temporary name and renamed over the old one, so a crash or `kill -9` at any
moment leaves either the previous complete file or the new complete file. `ResultWriter` writes them on
a background thread, so that training never waits for the disk.
"""

import csv
import errno
import fcntl
import math
import os
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import torch

from processes import UserError, first_line

CSV_NAME, PLOT_NAME, CHECKPOINT_NAME = "pytorch_res.csv", "pytorch_res.png", "checkpoint.pt"
RESULT_FILES = (CSV_NAME, PLOT_NAME, CHECKPOINT_NAME)
FEW_STEPS = 10  # fewer optimizer steps per epoch than this: the first line warns that the batch is large for the data
PLOT_SHARE = 0.02  # the picture is redrawn at most this share of the time (it is the slowest file to write)

# The per-epoch row: the CSV's columns in order, what each holds, and its part of the console line (None: CSV
# only). Adding a column is one line here and its value where train() builds the row; rows saved before a
# column existed get an empty cell.
COLUMNS: dict[str, tuple[str, str | None]] = {
    "epoch": ("the epoch, from 1", None),
    "loss": ("mean training loss over every image of the epoch on all ranks, label smoothing included", "loss {:.4f}"),
    "acc": ("test accuracy, 0..1, of the weights the checkpoint holds: every test image exactly once", "acc {:.4f}"),
    "test_loss": ("mean test loss, plain cross-entropy", "test_loss {:.4f}"),
    "train_acc": ("share of the epoch's (augmented) training images classified right", None),
    "lr": ("learning rate at the epoch's last step", "lr {:.4g}"),
    "epoch_seconds": ("this epoch's training steps and evaluation, nothing else", "{:.1f} s"),
    "elapsed_seconds": ("wall clock from the launcher's start to this epoch's end (a resume adds its own)", None),
    "images_per_second": ("training images of all ranks per second of training steps", "{:,.0f} img/s"),
    "peak_memory_mb": ("peak memory of the largest rank: GPU memory allocated, or resident memory on CPU", None),
    "write_wait_seconds": ("seconds training waited for the previous epoch's files (0 unless the disk is slow)", None),
}


def checked_row(row: dict[str, Any]) -> dict[str, float]:
    """The row with plain numbers, which any checkpoint holds (a numpy or tensor value does not load under
    weights_only). Every rank builds the same row, so a key that is no column or a value that is no number
    stops every rank alike at epoch 1, before any file is written."""
    for key, value in row.items():
        if key not in COLUMNS:
            raise UserError(f"the row's {key!r} is not in outputs.COLUMNS; add it there, or leave it out of the row")
        try:
            row[key] = value if type(value) in (int, float) else float(value)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"the row's {key} is {type(value).__name__}, not a number; give the row a number") from None
    return row


# ----------------------------------------------------------------------------- the background writer


_UNFINISHED: set["ResultWriter"] = set()  # writers whose close() has not run (finish_writers)


class ResultWriter:
    """Writes each epoch's checkpoint, CSV and picture on a background thread, in that order.

    At most one epoch is pending: `wait()` blocks until the previous epoch's files are on disk, so a
    `kill -9` loses no more than the epoch in flight. The caller hands over a snapshot on the CPU (training
    goes on changing the model): on a GPU the copies are queued behind the epoch's kernels, and an event says
    when they are done. `close()` finishes everything, on every way out of a run."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-writer")
        self.pending: Future | None = None
        self.saved: list[dict[str, float]] = []  # the rows whose checkpoint and CSV are on disk
        self.plotted_rows = -1
        self.next_plot = 0.0  # time.monotonic() before which the picture is not redrawn
        _UNFINISHED.add(self)

    def wait(self) -> float:
        """Block until the files handed over last are on disk; the seconds waited. Any failed write raises
        UserError naming the file, the reason and the fix."""
        if self.pending is None:
            return 0.0
        started = time.perf_counter()
        try:
            self.pending.result()  # a signal here leaves it pending: close() still finishes it
        except Exception as e:  # a full disk, a file-size limit, permissions, or a bug: one line on every rank
            self.pending = None
            raise UserError(write_failure(e, self.output_dir)) from None
        self.pending = None
        return time.perf_counter() - started

    def submit(self, checkpoint: dict[str, Any], history: list[dict[str, float]]) -> None:
        """Hand over one epoch's files (its checkpoint is copied to the CPU now); call wait() first."""
        assert self.pending is None, "wait() for the previous epoch first"
        snapshot = cpu_snapshot(checkpoint)
        ready = torch.cuda.Event() if torch.cuda.is_initialized() else None  # training on a GPU
        if ready is not None:
            ready.record()
        self.pending = self.pool.submit(self._write, snapshot, list(history), ready)

    def close(self) -> None:
        """Finish the pending files and draw the picture of every epoch whose files were written (after a failed
        write, those before it: the picture never shows an epoch that the CSV and the checkpoint do not hold)."""
        try:
            self.wait()
            if self.saved and self.plotted_rows != len(self.saved):
                plot_history(self.saved, self.output_dir)
        finally:
            self.pool.shutdown()
            _UNFINISHED.discard(self)

    def _write(self, snapshot: dict[str, Any], history: list[dict[str, float]], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies of the snapshot are done
        save_checkpoint(snapshot, self.output_dir)  # first: the CSV can always be rebuilt from it
        write_csv(history, self.output_dir)
        self.saved = history
        if time.monotonic() >= self.next_plot:
            started = time.monotonic()
            plot_history(history, self.output_dir)
            self.plotted_rows = len(history)
            self.next_plot = time.monotonic() + (time.monotonic() - started) / PLOT_SHARE


def finish_writers() -> None:
    """Close every writer whose close() a stop signal cut off as it began. That happens when the signal was held
    up in a collective that a peer left: it lands as the peer's "Connection closed" unwinds, on close()'s first
    line. The files first, then the line that names their epoch (it raises once: this close() runs to its end)."""
    for writer in list(_UNFINISHED):
        writer.close()


def write_failure(error: Exception, output_dir: str) -> str:
    """Why a write failed, what to do, and whether there is a checkpoint to continue from."""
    where = getattr(error, "filename", None) or f"the files in {output_dir}"
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if getattr(error, "errno", None) == errno.EFBIG or (
        not isinstance(error, OSError) and size_limit != resource.RLIM_INFINITY
    ):
        reason, fix = f"the file size limit, ulimit -f, is {size_limit // 1024} KB", "raise it (ulimit -f unlimited)"
    elif isinstance(error, OSError) and error.strerror:
        reason, fix = error.strerror, "free space or choose another --output_dir"
    elif shutil.disk_usage(output_dir).free < 2**26:  # torch.save reports a full disk without its cause
        reason, fix = "No space left on device", "free space or choose another --output_dir"
    else:
        reason, fix = f"{type(error).__name__}: {first_line(error, 100)}", "check the disk and its free space"
    kept = checkpoint_epoch(output_dir)
    then = f"continue with --resume True (the checkpoint of epoch {kept} is kept)" if kept else "start the run again"
    return f"could not write {where} ({reason}); {fix}, then {then}"


def cpu_snapshot(value: Any) -> Any:
    """A copy on the CPU of every tensor in nested dicts and lists. From a GPU the copies are queued
    (non-blocking); record an event after them and wait for it before reading."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", non_blocking=True, copy=True)
    if isinstance(value, dict):
        return {key: cpu_snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_snapshot(item) for item in value)
    return value


def all_ranks_peak_memory_mb(device: torch.device) -> float:
    """Peak memory of the largest rank: GPU memory allocated, or the process's resident size on CPU."""
    if device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    peak = torch.tensor([mine], device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return round(peak.item(), 1)


# ----------------------------------------------------------------------------- files


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """write(temporary_path), then rename it to `path` in one step."""
    temporary = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"  # the writer thread and close() never share one
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def lock_file(path: str, wait: bool = True) -> IO[str]:
    """An OS lock (flock) on `path`, held until the returned file is closed or the process ends, however it
    ends: the kernel releases it. With wait=False, BlockingIOError says another process holds it."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        handle.close()
        raise
    return handle


def save_checkpoint(state: dict[str, Any], output_dir: str) -> None:
    write_atomically(os.path.join(output_dir, CHECKPOINT_NAME), lambda tmp: torch.save(state, tmp))


def load_checkpoint(output_dir: str, lazily: bool = False) -> dict[str, Any]:
    """Tensors and plain Python values only (weights_only), on the CPU. `lazily`: tensors are read from
    the file when first used (mmap), so that looking at the epoch or the settings costs nothing."""
    path = os.path.join(output_dir, CHECKPOINT_NAME)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=lazily)


def checkpoint_epoch(output_dir: str) -> int:
    """The epoch of the checkpoint in output_dir; 0 if there is none that can be read."""
    try:
        return int(load_checkpoint(output_dir, lazily=True)["epoch"])
    except Exception:
        return 0


def write_csv(history: list[dict[str, float]], output_dir: str) -> None:
    def write(path: str) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(COLUMNS), restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(history)

    write_atomically(os.path.join(output_dir, CSV_NAME), write)


def plot_history(history: list[dict[str, float]], output_dir: str) -> None:
    """Loss, accuracy and learning rate against epoch, as a PNG (no display needed)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe on a background thread

    def column(name: str, scale: float = 1.0) -> list[float]:
        return [scale * row[name] if isinstance(row.get(name), (int, float)) else math.nan for row in history]

    epochs = column("epoch")
    figure = Figure(figsize=(13, 3.8))
    loss_ax, acc_ax, lr_ax = figure.subplots(1, 3)
    loss_ax.plot(epochs, column("loss"), "o-", label="train loss (label-smoothed)")
    loss_ax.plot(epochs, column("test_loss"), "s-", label="test loss")
    loss_ax.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    acc_ax.plot(epochs, column("acc", 100), "o-", color="tab:green", label="test")
    acc_ax.plot(epochs, column("train_acc", 100), "--", color="tab:olive", label="train")
    acc_ax.set(title=f"Accuracy (best test {max(column('acc', 100)):.2f}%)", xlabel="epoch", ylabel="accuracy (%)")
    lr_ax.plot(epochs, column("lr"), "o-", color="tab:purple")
    lr_ax.set(title="Learning rate (at epoch end)", xlabel="epoch", ylabel="learning rate")
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.grid(alpha=0.3)
    loss_ax.legend()
    acc_ax.legend()
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.91, wspace=0.22)
    write_atomically(os.path.join(output_dir, PLOT_NAME), lambda tmp: figure.savefig(tmp, dpi=110, format="png"))


# ----------------------------------------------------------------------------- the console


def describe(run: Any, peak_lr: float) -> str:
    """Rank 0's first line: what the run is, and how long it took to get to its first step; then any warning."""
    cfg, info, size = run.cfg, run.dist_info, run.cfg.IMAGE_SIZE
    parameters = sum(p.numel() for p in run.model.parameters())
    options = [("compiled", cfg.COMPILE), ("SyncBatchNorm", cfg.SYNC_BN), ("bf16 all-reduce", cfg.BF16_ALLREDUCE)]
    extras = [name for name, on in [*options, (f"{cfg.ACCUMULATE} micro-batches", cfg.ACCUMULATE > 1)] if on]
    resized = f", {run.data['resized']:,} resized to {size}x{size}" if run.data["resized"] else ""
    skipped = run.data.get("skipped", 0)
    skipped = f", {skipped:,} other files or folders skipped" if skipped else ""
    width = f"width={cfg.WIDTH}, " if hasattr(cfg, "WIDTH") else ""  # settings of another network may differ
    blocks = "" if getattr(cfg, "RELU_AFTER_SUM", True) else ", seed blocks"
    parts = [
        f"{type(run.model).__name__}({width}{parameters:,} parameters{blocks}) on {cfg.DATASET} "
        f"({len(run.train_data):,} train, {len(run.test_data):,} test images{resized}{skipped})",
        run.data["loader"],
        f"{info.world_size} rank(s) on {info.device.type} ({info.backend})",
        f"global batch {cfg.BATCH_SIZE} ({cfg.BATCH_SIZE // info.world_size} per rank), "
        f"{run.steps_per_epoch} steps per epoch, {cfg.EPOCHS} epochs",
        f"{cfg.OPTIMIZER} peak lr {peak_lr:.4g}",
        "bf16 autocast" if run.bf16 else "fp32",
        *extras,
        f"start-up {time.time() - run.launched_at:.1f} s",
    ]
    line = " | ".join(parts)
    if len(run.data["classes"]) == 1:  # not a mistake for the run, but nothing is learned
        line += (
            f"\nwarning: the data has one class ({run.data['classes'][0]}): every prediction is right, so acc is "
            f"1.0 and the loss 0 whatever the network learns; put each class's images in a folder of its own"
        )
    if run.steps_per_epoch < FEW_STEPS:
        line += (
            f"\nwarning: an epoch has only {run.steps_per_epoch} steps ({len(run.train_data):,} images, global "
            f"batch {cfg.BATCH_SIZE}); the recipe needs more: lower --batch_size for a data set this small"
        )
    return line


def epoch_line(row: dict[str, float], epochs: int) -> str:
    shown = [fmt.format(row[name]) for name, (_, fmt) in COLUMNS.items() if fmt and name in row]
    return f"epoch {row['epoch']:>{len(str(epochs))}}/{epochs}  " + "  ".join(shown)


def summary_line(history: list[dict[str, float]], output_dir: str) -> str:
    if not history:
        return "nothing to do: every epoch is already done"
    best = max(history, key=lambda row: row["acc"])
    training = sum(row.get("epoch_seconds", 0.0) for row in history)
    waited = sum(row.get("write_wait_seconds", 0.0) or 0.0 for row in history)
    mean_speed = sum(row["images_per_second"] for row in history) / len(history)
    files = ", ".join(os.path.join(output_dir, name) for name in RESULT_FILES)
    return (
        f"done: {len(history)} epochs in {format_seconds(history[-1]['elapsed_seconds'])} "
        f"({training:.1f} s training and evaluation, {waited:.1f} s waiting for files, the rest start-up); "
        f"best acc {best['acc']:.4f} (epoch {best['epoch']}), final acc {history[-1]['acc']:.4f}; "
        f"mean {mean_speed:,.0f} img/s; results: {files}"
    )


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


class Progress:
    """One epoch's progress bar on rank 0's terminal (tqdm; off when stdout is not a terminal). The loss and
    images/s are refreshed every `every` steps from the running sums; on a GPU from a copy queued at the
    refresh before, so that the thread launching kernels never waits for the device."""

    def __init__(self, enabled: bool, every: int, epoch: int, epochs: int, steps: int, world_size: int) -> None:
        from tqdm import tqdm

        on = enabled and sys.stdout.isatty()
        # delay: first drawn by update(), inside train_epoch's `with closing(...)`, so that a Ctrl-C landing as
        # the bar first shows still closes it before the run's last line
        options = {"unit": "step", "leave": False, "file": sys.stdout, "delay": 1e-9}
        self.bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", **options) if on else None
        self.every, self.world_size, self.started = max(1, every), world_size, time.perf_counter()
        self.queued: tuple[torch.Tensor, Any] | None = None  # GPU: (host copy of the sums, its event)

    def update(self, step: int, sums: torch.Tensor) -> None:
        if self.bar is None:
            return
        self.bar.update()
        if (step + 1) % self.every:
            return
        if not sums.is_cuda:
            self._show(sums.tolist())
            return
        if self.queued is not None and self.queued[1].query():
            self._show(self.queued[0].tolist())
        copy = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        copy.copy_(sums, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self.queued = (copy, landed)

    def _show(self, sums: list[float]) -> None:
        loss_sum, _, images = sums  # this rank's; the others train at the same pace
        speed = self.world_size * images / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"loss {loss_sum / max(images, 1):.4f}  {speed:,.0f} img/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
