"""Does a finished run exit 0 every time? N short runs, spawned and under torchrun, each judged clean only if
it exited 0, printed no abort or traceback line, and left a CSV with every epoch.

    python -m benchmarks.stress                      # 50 spawned runs and 10 torchrun runs
    python -m benchmarks.stress --spawned 20 --torchrun 0
    python -m benchmarks.stress --spawned 0 --torchrun 0 --ctrl_c_at_start 45   # Ctrl-C as the ranks start
    python -m benchmarks.stress --spawned 0 --torchrun 0 --folder_runs 200 --folder_stops 50   # image folders

--folder_runs: runs of --folder_epochs epochs on an image folder (DataLoader workers decoding files, an evaluation
pass every epoch), each clean if it exits 0 within --timeout seconds (a hang does not) with every epoch in its CSV,
and no process of it is left. --folder_stops: the same run stopped by SIGTERM at a moment drawn uniformly from its
launch to the end of a normal run's time, then at once `--output_dir DIR --resume True` (a new run where no
checkpoint was written yet): clean if that start is accepted and finishes every epoch, and no process of either is
left. More epochs put more of the stops in the middle of training rather than in the start.

Each run: synthetic data, width 8, 1 epoch, 2 CPU ranks (the shape of run that used to abort at exit). A
--ctrl_c_at_start run gets SIGINT on its whole process group as soon as both ranks exist; it is clean if it
exits 130 and prints at most one line, `interrupted: ...` (a peer's C++ error line was the failure seen).
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "train_distribute.py")
SETTINGS = ["--dataset=synthetic", "--synthetic_size=2000", "--width=8", "--epochs=1", "--batch_size=256"]
ABORT_SIGNS = ("terminate called", "SIGABRT", "Traceback", "was killed by", "core dumped")


def csv_rows(output_dir: str) -> int:
    return len(pd.read_csv(csv)) if (csv := Path(output_dir, "pytorch_res.csv")).exists() else 0


def one_run(launcher: str, output_dir: str) -> str:
    """'' for a clean run, else what was wrong with it."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN]
    else:
        command = [sys.executable, TRAIN, "--world_size=2"]
    command += [*SETTINGS, f"--output_dir={output_dir}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output, rows = result.stdout + result.stderr, csv_rows(output_dir)
    problems = [f"exit {result.returncode}"] * bool(result.returncode)
    problems += [f"'{sign}' in its output" for sign in ABORT_SIGNS if sign in output]
    problems += [f"{rows} CSV rows"] * (rows != 1)
    if problems:  # what it printed last, to see why
        problems.append("its last lines: " + " | ".join(output.strip().splitlines()[-3:]))
    return ", ".join(problems)


def ctrl_c_at_start(output_dir: str) -> str:
    """'' for a clean run, else what was wrong with it."""
    command = [sys.executable, TRAIN, "--world_size=2", *SETTINGS, f"--output_dir={output_dir}"]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
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


FOLDER = ["--dataset=imagefolder", "--image_size=16", "--width=8", "--batch_size=48"]


def image_folder(root: Path) -> None:
    """300 training and 60 test PNGs of 16x16 noise in two classes, one brighter."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 300), ("test", 60)):
        for i in range(count):
            (root / split / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 160, (16, 16, 3)) + 90 * (i % 2)
            Image.fromarray(pixels.astype(np.uint8)).save(root / split / "ab"[i % 2] / f"{i:04d}.png")


def left_behind(marker: str) -> list[int]:
    """Processes whose environment holds the run's marker (every process a run starts inherits it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes() and Path(environ.parent, "stat").read_text().split()[2] != "Z":
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def folder_run(args: list[str], marker: str, timeout: float, stop_at: float | None = None) -> tuple[int, str]:
    """`python train_distribute.py *args` on the image folder; with stop_at, SIGTERM to it that many seconds after its
    launch. Its exit code (-1: a hang, killed after `timeout`) and its output's last lines."""
    command, env = [sys.executable, TRAIN, *args], {**os.environ, "STRESS_MARKER": marker}
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        if stop_at is not None:
            try:
                run.wait(stop_at)
            except subprocess.TimeoutExpired:
                run.send_signal(signal.SIGTERM)
        output, code = run.communicate(timeout=timeout)[0], run.returncode
    except subprocess.TimeoutExpired:
        for pid in left_behind(marker):
            os.kill(pid, signal.SIGKILL)
        output, code = run.communicate()[0], -1
    return code, " | ".join(output.strip().splitlines()[-2:])


def trouble(output_dir: str, marker: str, epochs: int) -> list[str]:
    """What is wrong with a folder run's end: rows missing from its CSV, processes of it left."""
    rows = csv_rows(output_dir)
    return [f"{rows} rows"] * (rows != epochs) + [f"left: {left_behind(marker)}"] * bool(left_behind(marker))


def folder_runs(count: int, stops: int, timeout: float, epochs: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        image_folder(Path(scratch, "images"))
        base = [*FOLDER, f"--epochs={epochs}", f"--data_dir={scratch}/images"]
        durations, clean, started = [], 0, time.monotonic()
        for i in range(max(count, 1 if stops else 0)):  # with stops only: one run, to time a normal run
            out, marker, begun = f"{scratch}/run{i}", f"stress-run-{i}-{os.getpid()}", time.monotonic()
            code, said = folder_run([*base, f"--output_dir={out}"], marker, timeout)
            durations.append(time.monotonic() - begun)
            problems = [f"exit {code}"] * (code != 0) + trouble(out, marker, epochs)
            clean += not problems
            if problems:
                print(f"folder run {i + 1}: {', '.join(problems)}: {said}")
        seconds = time.monotonic() - started
        print(f"folder runs: {clean} of {len(durations)} clean (exit 0, every epoch, nothing left) in {seconds:.0f} s")
        typical, clean, started = float(np.median(durations)), 0, time.monotonic()
        for i in range(stops):
            out, marker, at = f"{scratch}/stop{i}", f"stress-stop-{i}-{os.getpid()}", random.uniform(0, typical)
            stopped, _ = folder_run([*base, f"--output_dir={out}"], marker, timeout, stop_at=at)
            again = ["--resume=True"] if Path(out, "checkpoint.pt").exists() else base  # the checkpoint knows the rest
            code, said = folder_run([*again, f"--output_dir={out}"], marker, timeout)
            problems = ["the stopped run hung"] * (stopped == -1) + [f"then exit {code}"] * (code != 0)
            problems += trouble(out, marker, epochs)
            clean += not problems
            how = "resumed" if again[0] == "--resume=True" else "started anew"
            print(f"stop {i + 1} at {at:.1f} s (exit {stopped}), {how}: {', '.join(problems) or 'clean'}: {said}")
        seconds = time.monotonic() - started
        print(f"folder stops: {clean} of {stops} clean (accepted, every epoch, nothing left) in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawned", type=int, default=50, help="runs started by python train_distribute.py")
    parser.add_argument("--torchrun", type=int, default=10, help="runs started by torchrun --standalone")
    parser.add_argument("--ctrl_c_at_start", type=int, default=0, help="spawned runs stopped as the ranks start")
    parser.add_argument("--folder_runs", type=int, default=0, help="image-folder runs to their end")
    parser.add_argument("--folder_stops", type=int, default=0, help="image-folder runs stopped by SIGTERM, resumed")
    parser.add_argument("--folder_epochs", type=int, default=3, help="epochs of a folder run")
    parser.add_argument("--timeout", type=float, default=300, help="seconds after which a folder run is a hang")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each run's line as it ends, in a log too
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every run on the CPU
    if args.folder_runs or args.folder_stops:
        folder_runs(args.folder_runs, args.folder_stops, args.timeout, args.folder_epochs)
    counts = {"spawned": args.spawned, "torchrun": args.torchrun, "ctrl_c": args.ctrl_c_at_start}
    for launcher, count in ((launcher, count) for launcher, count in counts.items() if count):
        clean, started = 0, time.monotonic()
        with tempfile.TemporaryDirectory() as scratch:
            for i in range(count):
                folder = os.path.join(scratch, f"run{i}")
                problem = ctrl_c_at_start(folder) if launcher == "ctrl_c" else one_run(launcher, folder)
                clean += not problem
                if problem:
                    print(f"{launcher} run {i + 1}: {problem}")
        clean_means = "exit 130, one line" if launcher == "ctrl_c" else "exit 0, no abort line, full CSV"
        print(f"{launcher}: {clean} of {count} runs clean ({clean_means}) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
