"""The accuracy table of docs/accuracy.md: recipes side by side at width 16, 5 epochs, 2 CPU ranks, on the holdout
split of an image folder, two seeds each. Prints mean accuracy, the spread between seeds, the gain over the first
row and the median seconds per epoch (training and evaluation).

    python -m benchmarks.accuracy --data_dir DIR                 # every row (about 4-6 minutes a run on 2 cores)
    python -m benchmarks.accuracy --data_dir DIR --rows default  # some rows only

A run already complete in --runs is read rather than run again, so an interrupted table continues where it was.
"""

import argparse
import os
import statistics
import subprocess
import sys

import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, WIDTH = 5, 16
# each row: a name (its runs' folder) and the settings it changes against the default recipe
ROWS = {
    "sgd": ["--optimizer", "sgd"],  # the default before Muon: Nesterov SGD for every parameter
    "sgd_no_label_smoothing": ["--optimizer", "sgd", "--label_smoothing", "0"],
    "muon": [],  # the default
}


def run_once(data_dir: str, runs: str, row: str, seed: int) -> pd.DataFrame:
    """One run of `row` with `seed` (or the CSV of an earlier complete one)."""
    out = os.path.join(runs, f"{row}-s{seed}")
    csv = os.path.join(out, "pytorch_res.csv")
    if not (os.path.exists(csv) and len(pd.read_csv(csv)) == EPOCHS):
        command = [sys.executable, os.path.join(ROOT, "train_distribute.py"), "--dataset", "imagefolder"]
        command += ["--data_dir", data_dir, "--width", str(WIDTH), "--epochs", str(EPOCHS), "--seed", str(seed)]
        command += ["--world_size", "2", "--output_dir", out, "--resume", "False", *ROWS[row]]
        print(" ".join(command[1:]), flush=True)
        code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode  # its error line goes to stderr
        if code != 0:
            sys.exit(f"the run of row {row}, seed {seed} failed with exit code {code}")
    return pd.read_csv(csv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="an image folder with train/ and test/ (the holdout)")
    parser.add_argument("--runs", default="runs/acc", help="where each run's files go")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    args = parser.parse_args()
    table, baseline = [], None
    for row in args.rows:
        runs = [run_once(args.data_dir, args.runs, row, seed) for seed in args.seeds]
        accs = [df["acc"].iloc[-1] for df in runs]
        mean = statistics.mean(accs)
        baseline = mean if baseline is None else baseline
        epoch_seconds = statistics.median(s for df in runs for s in df["epoch_seconds"].iloc[1:])
        seeds = " / ".join(f"{acc:.4f}" for acc in accs)
        table.append(
            f"| {row} | {seeds} | {mean:.4f} | {max(accs) - min(accs):.4f} | {100 * (mean - baseline):+.2f} "
            f"| {epoch_seconds:.1f} |"
        )
    print("| recipe | acc per seed | mean | spread | gain (points) | s per epoch |")
    print("|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
