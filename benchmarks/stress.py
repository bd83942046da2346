"""Does a finished run exit 0 every time? N short runs, spawned and under torchrun, each judged clean only if
it exited 0, printed no abort or traceback line, and left a CSV with every epoch.

    python -m benchmarks.stress                      # 50 spawned runs and 10 torchrun runs
    python -m benchmarks.stress --spawned 20 --torchrun 0
    python -m benchmarks.stress --spawned 0 --torchrun 0 --ctrl_c_at_start 45   # Ctrl-C as the ranks start

Each run: synthetic data, width 8, 1 epoch, 2 CPU ranks (the shape of run that used to abort at exit). A
--ctrl_c_at_start run gets SIGINT on its whole process group as soon as both ranks exist; it is clean if it
exits 130 and prints at most one line, `interrupted: ...` (a peer's C++ error line was the failure seen).
"""

import argparse
import os
import signal
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


def ctrl_c_at_start(output_dir: str) -> str:
    """'' for a clean run, else what was wrong with it."""
    command = [sys.executable, str(ROOT / "train_distribute.py"), "--world_size=2", *SETTINGS]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.Popen(
        [*command, f"--output_dir={output_dir}"], stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    while len(subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True).stdout.split()) < 2:
        if run.poll() is not None:  # ended before both ranks existed
            break
        time.sleep(0.005)  # the launcher's children: the two ranks, which torch's elastic agent starts
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    lines = err.strip().splitlines()
    if run.returncode == 130 and len(lines) <= 1 and all(line.startswith("interrupted: ") for line in lines):
        return ""
    return f"exit {run.returncode}, printed: " + " | ".join(lines[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawned", type=int, default=50, help="runs started by python train_distribute.py")
    parser.add_argument("--torchrun", type=int, default=10, help="runs started by torchrun --standalone")
    parser.add_argument("--ctrl_c_at_start", type=int, default=0, help="spawned runs stopped as the ranks start")
    args = parser.parse_args()
    for launcher, count in (("spawned", args.spawned), ("torchrun", args.torchrun), ("ctrl_c", args.ctrl_c_at_start)):
        if count == 0:
            continue
        clean, started = 0, time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            for i in range(count):
                folder = os.path.join(scratch, f"run{i}")
                problem = ctrl_c_at_start(folder) if launcher == "ctrl_c" else one_run(launcher, folder)
                clean += not problem
                if problem:
                    print(f"{launcher} run {i + 1}: {problem}", flush=True)
        seconds = time.monotonic() - started
        clean_means = "exit 130, one line" if launcher == "ctrl_c" else "exit 0, no abort line, full CSV"
        print(f"{launcher}: {clean} of {count} runs clean ({clean_means}) in {seconds:.0f} s")


if __name__ == "__main__":
    main()
