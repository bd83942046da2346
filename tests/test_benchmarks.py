"""The GPU check (benchmarks/gpu_check.sh and what it runs), proven on the CPU before a GPU is at hand: a GPU faked as
far as CUDA's first initialisation, and a dry run of every step at small sizes."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import distribute_tools
from benchmarks import throughput
from tests.conftest import BACKGROUND, HANG_TIMEOUT, ROOT, SETTINGS, clean_env, image_folder_of_noise, needs, scenario


class RanksStarted(Exception):
    pass


def test_throughput_initialises_no_cuda_before_it_forks_the_seeds_ranks(monkeypatch):
    """On a GPU the seed's ranks are forked from throughput.py's process: CUDA initialised there first would fail each
    of them ("Cannot re-initialize CUDA in forked subprocess"). A GPU is faked here as far as that initialisation."""
    events = []
    # what nvidia-smi prints on an H200 (answered here: a script written now could not be run while another thread's
    # fork still holds it open, "Text file busy")
    smi = subprocess.CompletedProcess(["nvidia-smi"], 0, "NVIDIA H200, 9.0\n", "")
    faked = SimpleNamespace(run=lambda command, **options: smi)  # throughput's own name: other threads keep theirs
    monkeypatch.setattr(throughput, "subprocess", faked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def lazy_init():
        events.append("CUDA initialised")
        raise AssertionError("CUDA initialised before the seed's ranks were forked")

    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)

    def run_distribute(*args):
        events.append("ranks started")
        raise RanksStarted

    monkeypatch.setattr(distribute_tools, "run_distribute", run_distribute)
    monkeypatch.setattr(sys, "argv", ["throughput", "--world_size=1", "--width=4", "--batch_size=8", "--steps=1"])
    with pytest.raises(RanksStarted):
        throughput.main()
    assert events == ["ranks started"]


def gpu_check_dry_run() -> tuple[subprocess.CompletedProcess, Path]:
    """`DRY_RUN=1 bash benchmarks/gpu_check.sh IMAGES RESULTS` with the tests' own interpreter (a venv need not be
    active), in the background as the session starts (conftest.needs): 40 s of new interpreters."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    image_folder_of_noise(folder / "images", train=64, test=32, size=32)
    command = ["nice", "-n", str(BACKGROUND), "bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(folder / "images")]
    command.append(str(folder / "results"))
    env = clean_env(DRY_RUN="1", PYTHON=sys.executable, PATH="/usr/bin:/bin")  # no python3 of ours on PATH
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=2 * HANG_TIMEOUT)  # a hang only
    return done, folder / "results"


gpu_check_dry_run.long = True  # (conftest.pytest_collection_finish)


@pytest.mark.skipif("WIDTH" not in SETTINGS, reason="the check runs the template ResNet at its own sizes")
@needs((gpu_check_dry_run,))
def test_the_gpu_check_runs_every_step_on_the_cpu_and_writes_each_steps_results():
    done, results = scenario(gpu_check_dry_run, timeout=3 * HANG_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (results / "summary.txt").read_text()
    for seed in (0, 1):
        assert f"accuracy, 1 epochs, seed {seed}: real " in summary and "1 epochs, final acc " in summary, summary
    assert "throughput: exit 0" in summary and "kernels: exit 0" in summary, summary
    assert {"a", "a'", "b", "c"} <= set(json.loads((results / "throughput.json").read_text())), summary
    kernels = (results / "kernels.md").read_text()
    assert "| wall clock, ms (no profiler) |" in kernels and kernels.count("slowest operator (CPU)s of ") == 2
    assert (results / "runs.tar.gz").stat().st_size > 0 and "done in " in summary
