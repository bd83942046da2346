"""Rank 0's files in OUTPUT_DIR and its console lines. Each is written to a temporary name and renamed over the old one
(a crash or kill -9 leaves the old whole file or the new one), on its own thread: training never waits for the disk."""

import copy
import os
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pandas as pd
import torch

from resnet import ResNet
from safeguards.failures import UserError, first_line

CSV_NAME, PLOT_NAME, CHECKPOINT_NAME, BEST_NAME = "pytorch_res.csv", "pytorch_res.png", "checkpoint.pt", "best.pt"
RESULT_FILES = (CSV_NAME, PLOT_NAME, CHECKPOINT_NAME, BEST_NAME)
EVENTS_PREFIX = "events.out.tfevents."  # TensorBoard's event files (TENSORBOARD=True)
PLOT_SHARE = 0.02  # the picture, the slowest file, is redrawn at most this share of the time
PROGRESS_EVERY = 60.0  # seconds between an epoch's progress lines in a log file (a terminal gets a live bar)
OTHER_NETWORKS = "--optimizer adam --lr 1e-3"  # the recipe's flags for a network swapped in (docs/accuracy.md)


class ResultWriter:
    """Writes each epoch's checkpoint, CSV and picture on a background thread, in that order. At most one is pending:
    wait() blocks until the previous epoch's files are on disk, so a kill -9 loses at most the epoch in flight."""

    def __init__(self, output_dir: str, tensorboard: bool = False, first_epoch: int = 1) -> None:
        self.output_dir, self.pool = output_dir, ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-writer")
        self.pending: Future | None = None
        self.saved: list[dict] = []  # the rows whose checkpoint and CSV are on disk
        self.plotted, self.next_plot, self.events = 0, 0.0, None
        if tensorboard:  # the package is needed only then (settings.check)
            from torch.utils.tensorboard import SummaryWriter

            self.events = SummaryWriter(output_dir, purge_step=first_epoch)  # the stopped run's later events: hidden

    def wait(self) -> float:
        """Seconds waited for the files handed over last; a failed write is one line naming the file and the fix."""
        started, pending, self.pending = time.perf_counter(), self.pending, None
        try:
            pending and pending.result()
        except Exception as e:  # a full disk, a file-size limit, permissions
            raise UserError(write_failure(e, self.output_dir)) from None
        return time.perf_counter() - started

    def submit(self, checkpoint: dict[str, Any], history: list[dict]) -> None:
        """Hand over one epoch's files, the checkpoint copied now (on a GPU queued: torch.save waits on the stream)."""
        self.pending = self.pool.submit(self._write, copy.deepcopy(checkpoint), list(history))

    def close(self) -> None:
        """Finish the pending files, then draw the picture of every epoch they hold (never of one that failed)."""
        try:
            self.wait()
            plot(self.saved, self.output_dir) if self.saved and self.plotted != len(self.saved) else None
        finally:
            self.pool.shutdown()
            self.events.close() if self.events else None

    def _write(self, snapshot: dict[str, Any], history: list[dict]) -> None:
        best = [BEST_NAME] * (best_row(history)[1] is history[-1])  # a new best epoch's best.pt before checkpoint.pt,
        for name in [*best, CHECKPOINT_NAME]:  # so that no checkpoint names a best epoch that best.pt lacks
            write_atomically(os.path.join(self.output_dir, name), lambda tmp: torch.save(snapshot, tmp))
        write_csv(history, self.output_dir)  # after the checkpoint: the CSV can always be rebuilt from it
        self.saved = history
        if self.events:  # TensorBoard's curves, beside the CSV: every numeric column
            for name, value in list(history[-1].items())[1:]:  # the epoch's step: the first column
                self.events.add_scalar(name, value, history[-1]["epoch"]) if isinstance(value, int | float) else None
            self.events.flush()
        if time.monotonic() >= self.next_plot:
            started = time.monotonic()
            plot(history, self.output_dir)
            self.plotted, self.next_plot = len(history), time.monotonic() + (time.monotonic() - started) / PLOT_SHARE


def write_failure(error: Exception, output_dir: str) -> str:
    """Why a write failed, what to do, and which checkpoint there is to continue from."""
    where = getattr(error, "filename", None) or f"the files in {output_dir}"
    reason = error.strerror if isinstance(error, OSError) else f"{type(error).__name__}: {first_line(error, 100)}"
    if shutil.disk_usage(output_dir).free < 2**26:  # torch.save reports a full disk without its cause
        reason = "No space left on device"
    failed = f"could not write {where} ({reason})"
    if not (kept := checkpoint_epoch(output_dir)):
        return f"{failed}; free space or choose another --output_dir, then start the run again"
    then = f"continue with --resume True (the checkpoint of epoch {kept} is kept)"
    elsewhere = f"or copy {os.path.join(output_dir, CHECKPOINT_NAME)} into another --output_dir and resume there"
    return f"{failed}; free space, then {then}, {elsewhere}"


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    temporary = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def load_checkpoint(output_dir: str) -> dict[str, Any]:
    """Tensors and plain Python values only, on the CPU; tensors read from the file when first used (mmap)."""
    return torch.load(os.path.join(output_dir, CHECKPOINT_NAME), map_location="cpu", weights_only=True, mmap=True)


def checkpoint_epoch(output_dir: str) -> int:
    """The epoch of the checkpoint in output_dir; 0 if there is none that can be read."""
    try:
        return int(load_checkpoint(output_dir)["epoch"])
    except Exception:
        return 0


def write_csv(history: list[dict], output_dir: str) -> None:
    write_atomically(os.path.join(output_dir, CSV_NAME), lambda tmp: pd.DataFrame(history).to_csv(tmp, index=False))


def plot(history: list[dict], output_dir: str) -> None:
    """Loss, accuracy and learning rate against epoch, as a PNG (matplotlib's Figure: no display, no global state)."""
    from matplotlib.figure import Figure

    rows, figure = pd.DataFrame(history).set_index("epoch"), Figure(figsize=(13, 3.8))
    loss, accuracy, lr = figure.subplots(1, 3, gridspec_kw={"left": 0.05, "right": 0.99, "bottom": 0.14, "wspace": 0.2})
    rows.filter(regex="loss$").plot(ax=loss, style="o-", title="Loss (train: label-smoothed)", grid=True)  # test, val
    best = f"Accuracy, % (best {(key := best_row(history)[0])} {100 * rows[key].max():.2f})"
    styles = {"acc": "o-", "val_acc": "o-", "train_acc": "--"}  # the columns there are: val_acc with HOLDOUT
    (100 * rows.filter(list(styles))).plot(ax=accuracy, style=styles, title=best, grid=True)
    rows.lr.plot(ax=lr, style="o-", title="Learning rate (at epoch end)", grid=True)
    write_atomically(os.path.join(output_dir, PLOT_NAME), lambda tmp: figure.savefig(tmp, dpi=110, format="png"))


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: GPU memory allocated, or resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def describe(model: torch.nn.Module, cfg: Any, info: Any, data: dict, steps: int, precision: str) -> str:
    """Rank 0's first line: what the run is, and what it does to the data (images stretched, images left out)."""
    width = f"width={model.width}, " if isinstance(getattr(model, "width", None), int) else ""  # the ResNet's knob
    parameters = f"{width}{sum(p.numel() for p in model.parameters()):,} parameters"
    images = f"{data['identity'].split(' of ')[0]} on {cfg.DATASET}"
    images += f" ({data['stretched']} stretched to {cfg.IMAGE_SIZE}x{cfg.IMAGE_SIZE})" if data["stretched"] else ""
    left = data["train_images"] - steps * cfg.BATCH_SIZE  # the last partial batch of every epoch
    batches = f"global batch {cfg.BATCH_SIZE}" + f" in {cfg.ACCUMULATE} micro-batches" * (cfg.ACCUMULATE > 1)
    batches += f", {steps} steps per epoch" + f" ({left:,} images left out each)" * (left > data["train_images"] / 100)
    ranks = f"{info.world_size} rank(s) on {info.device.type} ({info.backend})"
    run = f"{batches}, {cfg.EPOCHS} epochs | {cfg.OPTIMIZER} | {precision}"
    run += " | compiled: epoch 1 includes the compile time" if cfg.COMPILE else ""
    if cfg.SCHEDULE != "constant" and (total := steps * cfg.EPOCHS) < 10:  # a warm-up and a decay need a few steps
        run += f" | only {total} steps in all, too few for {cfg.SCHEDULE}: lower --batch_size or add epochs"
    if not isinstance(model, ResNet) and cfg.OPTIMIZER != "adam":  # Muon's and SGD's LR suit the template's ResNet
        run += f" | {cfg.OPTIMIZER}'s LR was tuned for resnet.py's ResNet: for another network try {OTHER_NETWORKS}"
    return f"{type(model).__name__}({parameters}) | {images} | loader {data['loader']} | {ranks} | {run}"


def progress(batches: Iterable, steps: int, epoch: int, cfg: Any) -> Iterator:
    """An epoch's batches: on a terminal a bar with rate and time left (tqdm), in a log a line per PROGRESS_EVERY. The
    clock starts after the first step (a compiled epoch's is the compile): its rate and time left are the steps'."""
    yield next(batches := iter(batches))  # (an epoch has a step at least: data.load)
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = {"unit": "img", "unit_scale": cfg.BATCH_SIZE, "leave": False, "dynamic_ncols": True, "initial": 1}
        yield from tqdm(batches, f"epoch {epoch}/{cfg.EPOCHS}", total=steps, **bar)
        return
    started = said = time.monotonic()
    for step, batch in enumerate(batches, 2):
        yield batch
        if (now := time.monotonic()) - said >= PROGRESS_EVERY:
            said, rate = now, (step - 1) / (now - started)
            done = f"{step:,} of {steps:,} steps, {rate * cfg.BATCH_SIZE:,.0f} img/s"
            print(f"epoch {epoch}/{cfg.EPOCHS}: {done}, {(steps - step) / rate / 60:.1f} min left", flush=True)


def best_row(history: list[dict]) -> tuple[str, dict | None]:
    """The column that picks the best epoch (HOLDOUT's val_acc, else acc) and that epoch's row (the later on a tie)."""
    key = "val_acc" if "val_acc" in history[0] else "acc"
    evaluated = [row for row in history if pd.notna(row[key])]
    return key, max(reversed(evaluated), key=lambda row: row[key]) if evaluated else None


def summary_line(history: list[dict], output_dir: str) -> str:
    """The last line: the best epoch (its checkpoint: best.pt) and the last evaluated one, by the selection column."""
    (key, best), done, where = best_row(history), f"done: {len(history)} epochs", f"results in {output_dir}"
    if not best:
        return f"{done}; {where}"
    final = [row[key] for row in history if pd.notna(row[key])][-1]
    return f"{done}; best {key} {best[key]:.4f} (epoch {best['epoch']}: {BEST_NAME}), final {key} {final:.4f}; {where}"
