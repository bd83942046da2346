"""What a run leaves in OUTPUT_DIR and shows on the console. Only global rank 0 calls these.

Every file is written to a temporary name and then renamed over the old one, so a crash or
`kill -9` at any moment leaves either the previous complete file or the new complete file.
"""
import math
import os
import shutil
import sys
import time
from typing import Any, Callable, Optional

import torch

CSV_NAME = "pytorch_res.csv"
PLOT_NAME = "pytorch_res.png"
CHECKPOINT_NAME = "checkpoint.pt"
RESULT_FILES = (CSV_NAME, PLOT_NAME, CHECKPOINT_NAME)


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """write(temporary_path), then rename it to `path` in one step."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
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


def write_csv(history: list[dict[str, float]], output_dir: str) -> None:
    import pandas as pd  # imported here: only rank 0 pays for it

    write_atomically(os.path.join(output_dir, CSV_NAME), lambda tmp: pd.DataFrame(history).to_csv(tmp, index=False))


def remove_stale_temporaries(output_dir: str) -> None:
    """Temporary files of a run killed in mid-write: never complete, never needed."""
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            if name.startswith(tuple(f"{result}.tmp" for result in RESULT_FILES)):
                os.remove(os.path.join(output_dir, name))


def move_aside_earlier_results(output_dir: str) -> Optional[str]:
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


def plot_history(history: list[dict[str, float]], output_dir: str) -> None:
    """Loss, accuracy and learning rate against epoch, as a PNG (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [row["epoch"] for row in history]
    figure, (loss_ax, acc_ax, lr_ax) = plt.subplots(1, 3, figsize=(13, 3.8))
    loss_ax.plot(epochs, [row["loss"] for row in history], "o-", label="train loss (label-smoothed)")
    loss_ax.plot(epochs, [row["test_loss"] for row in history], "s-", label="test loss")
    loss_ax.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    loss_ax.legend()
    acc_ax.plot(epochs, [100 * row["acc"] for row in history], "o-", color="tab:green", label="test")
    acc_ax.plot(epochs, [100 * row["train_acc"] for row in history], "--", color="tab:olive", label="train")
    acc_ax.set(title=f"Accuracy (best test {100 * max(r['acc'] for r in history):.2f}%)",
               xlabel="epoch", ylabel="accuracy (%)")
    acc_ax.legend()
    lr_ax.plot(epochs, [row["lr"] for row in history], "o-", color="tab:purple")
    lr_ax.set(title="Learning rate (at epoch end)", xlabel="epoch", ylabel="learning rate")
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.grid(alpha=0.3)
    figure.tight_layout()
    write_atomically(os.path.join(output_dir, PLOT_NAME), lambda tmp: figure.savefig(tmp, dpi=110, format="png"))
    plt.close(figure)


def epoch_line(row: dict[str, float], epochs: int) -> str:
    return (f"epoch {row['epoch']:>{len(str(epochs))}}/{epochs}  loss {row['loss']:.4f}  "
            f"test_loss {row['test_loss']:.4f}  acc {row['acc']:.4f}  lr {row['lr']:.4g}  "
            f"{row['epoch_seconds']:.1f} s  {row['images_per_second']:,.0f} img/s")


def summary_line(history: list[dict[str, float]], total_seconds: float, output_dir: str) -> str:
    if not history:
        return "nothing to do: every epoch is already done"
    best = max(history, key=lambda row: row["acc"])
    mean_speed = sum(row["images_per_second"] for row in history) / len(history)
    files = ", ".join(os.path.join(output_dir, name) for name in RESULT_FILES if os.path.exists(os.path.join(output_dir, name)))
    return (f"done: {len(history)} epochs in {format_seconds(total_seconds)}; best acc {best['acc']:.4f} "
            f"(epoch {best['epoch']}), final acc {history[-1]['acc']:.4f}; mean {mean_speed:,.0f} img/s; "
            f"results: {files}")


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


class Progress:
    """A progress bar for one epoch on a terminal: steps, images/s, running loss, ETA.

    Refreshed every `every` steps; each refresh reads the running sums once (one host sync per
    refresh, none per step). Off when stdout is not a terminal: then one plain line per epoch."""

    def __init__(self, enabled: bool, every: int) -> None:
        self.enabled = enabled and sys.stdout.isatty()
        self.every = max(1, every)

    def start(self, epoch: int, epochs: int, steps: int, world_size: int) -> None:
        self.epoch, self.epochs, self.steps, self.world_size = epoch, epochs, steps, world_size
        self.started = time.perf_counter()

    def due(self, step: int) -> bool:
        return self.enabled and ((step + 1) % self.every == 0 or step + 1 == self.steps)

    def show(self, step: int, sums: torch.Tensor) -> None:
        loss_sum, _, images = sums.tolist()  # this rank's; the others train at the same pace
        elapsed = time.perf_counter() - self.started
        done = step + 1
        eta = elapsed / done * (self.steps - done)
        filled = int(24 * done / self.steps)
        bar = "#" * filled + "." * (24 - filled)
        loss = loss_sum / images if images else math.nan
        sys.stdout.write(f"\repoch {self.epoch}/{self.epochs} [{bar}] {done}/{self.steps}  "
                         f"loss {loss:.4f}  {self.world_size * images / max(elapsed, 1e-9):,.0f} img/s  "
                         f"eta {format_seconds(eta)} ")
        sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
