"""Shared helpers: real processes on the CPU (gloo), tiny generated data, a few runs that several tests read."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the suite exercises the CPU/gloo path, also on a machine with GPUs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_distribute.py"
# A small, fast run: tiny network, synthetic images, several steps per epoch.
TINY = ["--dataset=synthetic", "--synthetic_size=1200", "--width=8", "--batch_size=96", "--world_size=2"]
HANG_TIMEOUT = 240  # seconds; a run that takes longer than this is hanging, not slow


def clean_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def run_script(
    *args: str, timeout: float = HANG_TIMEOUT, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd or ROOT,
        stdin=subprocess.DEVNULL,
    )


def torchrun_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def csv_rows(output_dir: Path) -> int:
    path = output_dir / "pytorch_res.csv"
    return len(pd.read_csv(path)) if path.exists() else 0


def wait_for_rows(output_dir: Path, rows: int, process: subprocess.Popen, timeout: float = HANG_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while csv_rows(output_dir) < rows:
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before writing {rows} rows"
        assert time.monotonic() < deadline, "no CSV rows in time: the run hangs"
        time.sleep(0.1)


def children_of(pid: int) -> list[int]:
    """Every descendant process of pid (Linux /proc)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent:
                    found.append(int(entry.name))
                    frontier.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, float]:
    """One uninterrupted 2-rank run of 5 epochs that several tests inspect, and its wall-clock seconds."""
    out = tmp_path_factory.mktemp("reference") / "out"
    started = time.monotonic()
    result = run_script(*TINY, "--epochs=5", f"--output_dir={out}")
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result, time.monotonic() - started
