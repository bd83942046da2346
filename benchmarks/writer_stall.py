"""What rank 0's files cost a run: written in line after every epoch (as this project did before) against
the background writer, side by side, alternating, on the same run.

    python -m benchmarks.writer_stall                  # width 8, 4,096 synthetic images, 8 epochs, 2 CPU ranks
    python -m benchmarks.writer_stall --rounds=3 --width=16

Each run is `python -m benchmarks.writer_stall --train ARGS`: train_distribute.main(ARGS) with its ranks forked from
that process (a function entrypoint), so that with WRITE_IN_LINE=1 they inherit the in-line writer, which writes the
checkpoint, CSV and picture of every epoch before training goes on. Both variants start the same way.

For each run: the median over epochs 2..N of (growth of elapsed_seconds) / epoch_seconds, which is 1.00
when nothing but training and evaluation happens between two epochs' clocks; the mean training images/s
over epochs 2..N; the whole process's wall clock; the seconds training waited for the writer.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def write_in_line() -> None:
    """The writes as they were: ResultWriter.submit writes the epoch's checkpoint, CSV and picture at once."""
    import torch

    from safeguards import files

    def submit(self: files.ResultWriter, checkpoint: dict, history: list) -> None:
        path = os.path.join(self.output_dir, files.CHECKPOINT_NAME)
        files.write_atomically(path, lambda tmp: torch.save(checkpoint, tmp))
        files.write_csv(history, self.output_dir)
        files.plot(history, self.output_dir)
        self.saved, self.plotted = list(history), len(history)  # close() has nothing left to write

    files.ResultWriter.submit = submit


def train(argv: list[str]) -> int:
    """The project's launcher in this process; its ranks are forked from it (they inherit the in-line writer)."""
    import train_distribute

    if os.environ.get("WRITE_IN_LINE") == "1":
        write_in_line()
    return train_distribute.main(argv, entrypoint=train_distribute.main)


def one_run(args: argparse.Namespace, in_line: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "benchmarks.writer_stall",
            "--train",
            "--dataset=synthetic",
            f"--synthetic_size={args.images}",
            f"--width={args.width}",
            f"--batch_size={args.batch_size}",
            f"--epochs={args.epochs}",
            f"--world_size={args.world_size}",
            f"--output_dir={out}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RESNET_DDP_", "TORCHELASTIC_"))}
        env.update(WRITE_IN_LINE="1" if in_line else "0", CUDA_VISIBLE_DEVICES="")
        started = time.monotonic()
        subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - started
        df = pd.read_csv(os.path.join(out, "pytorch_res.csv"))
    later = df.iloc[1:]
    growth = df["elapsed_seconds"].diff().iloc[1:] / later["epoch_seconds"]
    return {
        "stall ratio": growth.median(),
        "img/s": later["images_per_second"].mean(),
        "wall s": wall,
        "epochs s": df["epoch_seconds"].sum(),
        "waited s": df["write_wait_seconds"].sum(),
    }


def main() -> None:
    if sys.argv[1:2] == ["--train"]:
        sys.exit(train(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for round_ in range(args.rounds):
        for in_line in (True, False):
            result = one_run(args, in_line)
            rows.append({"round": round_ + 1, "writes": "in line" if in_line else "background", **result})
            print(
                pd.DataFrame(rows[-1:]).to_string(index=False, header=len(rows) == 1, float_format="%.3f"), flush=True
            )
    table = pd.DataFrame(rows).groupby("writes").mean(numeric_only=True).drop(columns="round")
    print("\nmeans:\n" + table.to_string(float_format="%.3f"))
    before, after = table.loc["in line"], table.loc["background"]
    print(
        f"background against in line: wall clock {after['wall s'] - before['wall s']:+.1f} s, training "
        f"images/s {100 * (after['img/s'] / before['img/s'] - 1):+.1f}%, stall ratio {before['stall ratio']:.3f} "
        f"-> {after['stall ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
