"""Does a finished run exit 0 every time? N short runs, spawned and under torchrun, each judged clean only if
it exited 0, printed no abort or traceback line, and left a CSV with every epoch.

    python -m benchmarks.stress                      # 50 spawned runs and 10 torchrun runs
    python -m benchmarks.stress --spawned 20 --torchrun 0

Each run: synthetic data, width 8, 1 epoch, 2 CPU ranks (the shape of run that used to abort at exit).
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
SETTINGS = ["--dataset=synthetic", "--synthetic_size=2000", "--width=8", "--epochs=1", "--batch_size=256"]
ABORT_SIGNS = ("terminate called", "SIGABRT", "Traceback", "was killed by", "core dumped")


def one_run(launcher: str, output_dir: str) -> str:
    """'' for a clean run, else what was wrong with it."""
    script = str(ROOT / "train_distribute.py")
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    else:
        command = [sys.executable, script, "--world_size=2"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*command, *SETTINGS, f"--output_dir={output_dir}"], capture_output=True, text=True, env=env, timeout=300
    )
    output = result.stdout + result.stderr
    signs = [sign for sign in ABORT_SIGNS if sign in output]
    csv = Path(output_dir, "pytorch_res.csv")
    rows = len(pd.read_csv(csv)) if csv.exists() else 0
    problems = [f"exit {result.returncode}"] if result.returncode else []
    problems += [f"'{sign}' in its output" for sign in signs]
    problems += [f"{rows} CSV rows"] if rows != 1 else []
    if problems:  # what it printed last, to see why
        problems.append("its last lines: " + " | ".join(output.strip().splitlines()[-3:]))
    return ", ".join(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawned", type=int, default=50, help="runs started by python train_distribute.py")
    parser.add_argument("--torchrun", type=int, default=10, help="runs started by torchrun --standalone")
    args = parser.parse_args()
    for launcher, count in (("spawned", args.spawned), ("torchrun", args.torchrun)):
        if count == 0:
            continue
        clean, started = 0, time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            for i in range(count):
                problem = one_run(launcher, os.path.join(scratch, f"run{i}"))
                clean += not problem
                if problem:
                    print(f"{launcher} run {i + 1}: {problem}", flush=True)
        seconds = time.monotonic() - started
        print(f"{launcher}: {clean} of {count} runs clean (exit 0, no abort line, full CSV) in {seconds:.0f} s")


if __name__ == "__main__":
    main()
