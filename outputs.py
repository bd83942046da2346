"""What a run leaves in OUTPUT_DIR and shows on the console. Only global rank 0 writes and prints;
for a resume, each machine's local rank 0 reads the checkpoint its own OUTPUT_DIR holds.

Every file is written to a temporary name and then renamed over the old one, so a crash or
`kill -9` at any moment leaves either the previous complete file or the new complete file.
`ResultWriter` writes them on a background thread, so that training never waits for the disk.
"""

import csv
import fcntl
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import IO, Any

import torch

import config
from distribute_tools import UserError, run_id

CSV_NAME = "pytorch_res.csv"
PLOT_NAME = "pytorch_res.png"
CHECKPOINT_NAME = "checkpoint.pt"
LOCK_NAME = ".lock"
RESULT_FILES = (CSV_NAME, PLOT_NAME, CHECKPOINT_NAME)
PLOT_SHARE = 0.02  # the picture is redrawn at most this share of the time (it is the slowest file to write)


# ----------------------------------------------------------------------------- the background writer


class ResultWriter:
    """Writes each epoch's checkpoint, CSV and picture on a background thread, in that order.

    At most one epoch is pending: `wait()` blocks until the previous epoch's files are on disk,
    so a `kill -9` loses no more than the epoch in flight. The caller hands over a snapshot on
    the CPU (training goes on changing the model) and, on a GPU, an event that says when the
    snapshot's copies are done. `close()` finishes everything, on every way out of a run."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-writer")
        self.pending: Future | None = None
        self.history: list[dict[str, float]] = []
        self.plotted_rows = -1
        self.next_plot = 0.0  # time.monotonic() before which the picture is not redrawn

    def wait(self) -> float:
        """Block until the files handed over last are on disk; the seconds waited. A failed write
        raises UserError naming the file."""
        if self.pending is None:
            return 0.0
        started = time.perf_counter()
        try:
            self.pending.result()  # a signal here leaves it pending: close() still finishes it
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            self.pending = None
            where = getattr(e, "filename", None) or f"the files in {self.output_dir}"
            reason = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            raise UserError(
                f"could not write {where} ({reason}); free space or choose another --output_dir, then "
                f"resume with --resume True"
            ) from None
        self.pending = None
        return time.perf_counter() - started

    def submit(self, snapshot: dict[str, Any], history: list[dict[str, float]], ready: Any = None) -> None:
        """Hand over one epoch's files; call wait() first."""
        assert self.pending is None, "wait() for the previous epoch first"
        self.history = list(history)
        self.pending = self.pool.submit(self._write, snapshot, self.history, ready)

    def close(self) -> None:
        """Finish the pending files and draw the picture of every epoch."""
        try:
            self.wait()
            if self.history and self.plotted_rows != len(self.history):
                plot_history(self.history, self.output_dir)
        finally:
            self.pool.shutdown()

    def _write(self, snapshot: dict[str, Any], history: list[dict[str, float]], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies of the snapshot are done
        save_checkpoint(snapshot, self.output_dir)  # first: the CSV can always be rebuilt from it
        write_csv(history, self.output_dir)
        if time.monotonic() >= self.next_plot:
            started = time.monotonic()
            plot_history(history, self.output_dir)
            self.plotted_rows = len(history)
            self.next_plot = time.monotonic() + (time.monotonic() - started) / PLOT_SHARE


def cpu_snapshot(value: Any) -> Any:
    """A copy on the CPU of every tensor in nested dicts and lists. From a GPU the copies are queued
    (pinned memory, non-blocking); record an event after them and wait for it before reading."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", non_blocking=True, copy=True)
    if isinstance(value, dict):
        return {key: cpu_snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_snapshot(item) for item in value)
    return value


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


def save_checkpoint(state: dict[str, Any], output_dir: str) -> None:
    write_atomically(os.path.join(output_dir, CHECKPOINT_NAME), lambda tmp: torch.save(state, tmp))


def load_checkpoint(output_dir: str) -> dict[str, Any]:
    """Tensors and plain Python values only (weights_only); every tensor lands on the CPU."""
    return torch.load(os.path.join(output_dir, CHECKPOINT_NAME), map_location="cpu", weights_only=True)


def checkpoint_epoch(output_dir: str) -> tuple[int, dict[str, str]]:
    """The epoch of the checkpoint in output_dir (-1 if there is none) and the run ids it was saved
    under (reads only what it needs)."""
    try:
        path = os.path.join(output_dir, CHECKPOINT_NAME)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["epoch"]), dict(checkpoint.get("run_ids", {}))
    except (OSError, RuntimeError, KeyError, ValueError):
        return -1, {}


def same_run(saved_by: dict[str, str], ours: dict[str, str]) -> bool:
    """Whether a checkpoint saved under the run ids `saved_by` belongs to the run named by `ours`."""
    return any(saved_by.get(kind) == name for kind, name in ours.items())


def read_resume_checkpoint(cfg: SimpleNamespace) -> dict[str, Any]:
    """The checkpoint in OUTPUT_DIR, once it is known to continue this same run."""
    path = os.path.join(cfg.OUTPUT_DIR, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise UserError(no_checkpoint_message(cfg.OUTPUT_DIR))
    try:
        checkpoint = load_checkpoint(cfg.OUTPUT_DIR)
    except Exception as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}); start a new run without --resume") from None
    config.check_resume(checkpoint["config"], cfg)
    return checkpoint


def no_checkpoint_message(output_dir: str) -> str:
    """RESUME=True found nothing to resume: say where a later run moved the last checkpoint, if it did."""
    moved = latest_moved_checkpoint(output_dir)
    hint = (
        f"; a later run moved the last one to {moved}: move its files back into {output_dir} to continue it"
        if moved
        else ""
    )
    return (
        f"RESUME=True but there is no {os.path.join(output_dir, CHECKPOINT_NAME)}{hint}; or run without "
        f"--resume to start a new run"
    )


def write_csv(history: list[dict[str, float]], output_dir: str) -> None:
    def write(path: str) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(history[0]))
            writer.writeheader()
            writer.writerows(history)

    write_atomically(os.path.join(output_dir, CSV_NAME), write)


def remove_stale_temporaries(output_dir: str) -> None:
    """Temporary files of a run killed in mid-write: never complete, never needed."""
    for name in os.listdir(output_dir):
        if name.startswith(tuple(f"{result}.tmp" for result in RESULT_FILES)):
            os.remove(os.path.join(output_dir, name))


def move_aside_earlier_results(output_dir: str) -> str | None:
    """A new run never overwrites an earlier one: its files move to OUTPUT_DIR/previous-<time>/."""
    found = [name for name in RESULT_FILES if os.path.exists(os.path.join(output_dir, name))]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(output_dir, found[0]))))
    destination = os.path.join(output_dir, f"previous-{stamp}")
    suffix = 1
    while os.path.exists(destination):
        suffix += 1
        destination = os.path.join(output_dir, f"previous-{stamp}-{suffix}")
    os.makedirs(destination)
    for name in found:
        shutil.move(os.path.join(output_dir, name), os.path.join(destination, name))
    return destination


def latest_moved_checkpoint(output_dir: str) -> str | None:
    """The newest previous-<time>/ folder that holds a checkpoint, if any."""
    if not os.path.isdir(output_dir):
        return None
    folders = [os.path.join(output_dir, name) for name in os.listdir(output_dir) if name.startswith("previous-")]
    with_checkpoint = [f for f in folders if os.path.exists(os.path.join(f, CHECKPOINT_NAME))]
    return max(with_checkpoint, key=lambda f: os.path.getmtime(os.path.join(f, CHECKPOINT_NAME)), default=None)


# ----------------------------------------------------------------------------- one run per folder


def check_output_dir(output_dir: str) -> None:
    """Before anything starts: OUTPUT_DIR is (or can become) a writable folder that no other run holds.
    Creates nothing."""
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(
            f"OUTPUT_DIR {output_dir} cannot be a folder: {existing} is a file; choose another "
            f"--output_dir or move that file"
        )
    if not os.access(existing, os.W_OK | os.X_OK) or (
        existing == os.path.abspath(output_dir) and not _can_create_file(existing)
    ):
        raise UserError(
            f"OUTPUT_DIR {output_dir} is not writable ({existing}); choose another --output_dir or fix its permissions"
        )
    lock = os.path.join(output_dir, LOCK_NAME)
    if os.path.exists(lock):
        _lock_or_refuse(lock, output_dir, same_run_wait_s=0).close()


def _can_create_file(folder: str) -> bool:
    probe = os.path.join(folder, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
        return True
    except OSError:
        return False


def claim_output_dir(output_dir: str, wait_for_same_run: bool = True) -> IO[str]:
    """The OS lock that makes this process the only writer of OUTPUT_DIR, held until the returned file
    is closed or the process ends, however it ends (the kernel releases it). Another run's lock is
    refused with one line; a restart of this same run (same torchrun run id or SLURM job) waits for its
    previous attempt's processes to go."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create OUTPUT_DIR {output_dir} ({e.strerror}); choose another --output_dir") from None
    handle = _lock_or_refuse(os.path.join(output_dir, LOCK_NAME), output_dir, 60 if wait_for_same_run else 0)
    handle.seek(0)
    handle.truncate()
    handle.write(
        f"pid={os.getpid()} host={socket.gethostname()} run={run_id()} since={time.strftime('%Y-%m-%d_%H:%M:%S')}\n"
    )
    handle.flush()
    return handle


def _lock_or_refuse(path: str, output_dir: str, same_run_wait_s: float) -> IO[str]:
    deadline = time.monotonic() + same_run_wait_s
    try:
        handle = open(path, "a+")
    except OSError as e:  # a read-only file system, say (under torchrun no launcher checked it before)
        raise UserError(
            f"OUTPUT_DIR {output_dir} is not writable ({e.strerror}: {path}); choose another --output_dir "
            f"or fix its permissions"
        ) from None
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            handle.seek(0)
            holder = dict(part.split("=", 1) for part in handle.read().split() if "=" in part)
            if holder.get("run") and holder.get("run") == run_id() and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            handle.close()
            raise UserError(
                f"OUTPUT_DIR {output_dir} is in use by another run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it to end or "
                f"choose another --output_dir"
            ) from None


# ----------------------------------------------------------------------------- the picture


def plot_history(history: list[dict[str, float]], output_dir: str) -> None:
    """Loss, accuracy and learning rate against epoch, as a PNG (no display needed)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe on a background thread

    epochs = [row["epoch"] for row in history]
    figure = Figure(figsize=(13, 3.8))
    loss_ax, acc_ax, lr_ax = figure.subplots(1, 3)
    loss_ax.plot(epochs, [row["loss"] for row in history], "o-", label="train loss (label-smoothed)")
    loss_ax.plot(epochs, [row["test_loss"] for row in history], "s-", label="test loss")
    loss_ax.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    loss_ax.legend()
    acc_ax.plot(epochs, [100 * row["acc"] for row in history], "o-", color="tab:green", label="test")
    acc_ax.plot(epochs, [100 * row["train_acc"] for row in history], "--", color="tab:olive", label="train")
    acc_ax.set(
        title=f"Accuracy (best test {100 * max(r['acc'] for r in history):.2f}%)", xlabel="epoch", ylabel="accuracy (%)"
    )
    acc_ax.legend()
    lr_ax.plot(epochs, [row["lr"] for row in history], "o-", color="tab:purple")
    lr_ax.set(title="Learning rate (at epoch end)", xlabel="epoch", ylabel="learning rate")
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.grid(alpha=0.3)
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.91, wspace=0.22)
    write_atomically(os.path.join(output_dir, PLOT_NAME), lambda tmp: figure.savefig(tmp, dpi=110, format="png"))


# ----------------------------------------------------------------------------- the console


def epoch_line(row: dict[str, float], epochs: int) -> str:
    return (
        f"epoch {row['epoch']:>{len(str(epochs))}}/{epochs}  loss {row['loss']:.4f}  "
        f"test_loss {row['test_loss']:.4f}  acc {row['acc']:.4f}  lr {row['lr']:.4g}  "
        f"{row['epoch_seconds']:.1f} s  {row['images_per_second']:,.0f} img/s"
    )


def summary_line(history: list[dict[str, float]], output_dir: str) -> str:
    if not history:
        return "nothing to do: every epoch is already done"
    best = max(history, key=lambda row: row["acc"])
    mean_speed = sum(row["images_per_second"] for row in history) / len(history)
    training = sum(row["epoch_seconds"] for row in history)
    waited = sum(row["write_wait_seconds"] for row in history)
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
    """A progress bar for one epoch on a terminal: steps, images/s, running loss, ETA.

    Refreshed every `every` steps from the running sums. On a GPU it never waits for them: each refresh
    queues a copy of the sums to the host and shows the previous refresh's copy once it has landed, so
    the thread that launches kernels is never held up (the bar lags one refresh). Off when stdout is
    not a terminal: then one plain line per epoch."""

    def __init__(self, enabled: bool, every: int, epoch: int, epochs: int, steps: int, world_size: int) -> None:
        self.enabled = enabled and sys.stdout.isatty()
        self.every = max(1, every)
        self.epoch, self.epochs, self.steps, self.world_size = epoch, epochs, steps, world_size
        self.started = time.perf_counter()
        self.in_flight: tuple[torch.Tensor, Any, int, float] | None = None  # GPU: (copy, event, steps, time)

    def update(self, step: int, sums: torch.Tensor) -> None:
        if not self.enabled or ((step + 1) % self.every and step + 1 != self.steps):
            return
        done, now = step + 1, time.perf_counter()
        if not sums.is_cuda:
            self.show(sums.tolist(), done, now - self.started)
            return
        if self.in_flight is not None:
            copy, landed, copied_at_step, copied_at = self.in_flight
            if not landed.query():
                return  # the previous copy is still queued: skip this refresh rather than wait
            self.show(copy.tolist(), copied_at_step, copied_at - self.started)
        copy = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        copy.copy_(sums, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self.in_flight = (copy, landed, done, now)

    def show(self, sums: list[float], done: int, elapsed: float) -> None:
        loss_sum, _, images = sums  # this rank's; the others train at the same pace
        eta = elapsed / done * (self.steps - done)
        filled = int(24 * done / self.steps)
        bar = "#" * filled + "." * (24 - filled)
        loss = loss_sum / images if images else math.nan
        sys.stdout.write(
            f"\repoch {self.epoch}/{self.epochs} [{bar}] {done}/{self.steps}  "
            f"loss {loss:.4f}  {self.world_size * images / max(elapsed, 1e-9):,.0f} img/s  "
            f"eta {format_seconds(eta)} "
        )
        sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
