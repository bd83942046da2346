"""End to end: the training script with real processes (2 gloo ranks on the CPU) on tiny synthetic data."""
import contextlib
import json
import math
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import distribute_tools as dt
from tests import workers
from tests.conftest import (HANG_TIMEOUT, SCRIPT, TINY, alive, children_of, clean_env, csv_rows, free_port,
                            run_script, torchrun_command, wait_for_rows)

COLUMNS = ["epoch", "loss", "acc", "test_loss", "train_acc", "lr", "epoch_seconds", "images_per_second",
           "peak_memory_mb"]


@pytest.fixture
def own_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ----------------------------------------------------------------------------- one normal run, read many ways


def test_two_ranks_write_one_row_per_epoch_and_learn(reference_run):
    out, _ = reference_run
    df = pd.read_csv(out / "pytorch_res.csv")
    assert list(df.columns) == COLUMNS
    assert df["epoch"].tolist() == [1, 2, 3, 4, 5]
    assert df["acc"].between(0, 1).all() and (df["images_per_second"] > 0).all() and (df["lr"] > 0).all()
    assert df["acc"].iloc[-1] > 0.5, "10 classes: chance is 0.1"
    assert df["loss"].iloc[-1] < df["loss"].iloc[0]
    # train loss is the mean over every image of the epoch on all ranks, so it is bounded by the extremes
    assert df["train_acc"].iloc[-1] > 0.5


def test_only_rank_0_speaks_in_plain_lines_when_not_on_a_terminal(reference_run):
    _, result = reference_run
    assert result.stderr.strip() == "", result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 + 5 + 1, result.stdout  # what the run is, one line per epoch, the summary
    assert lines[0].startswith("ResNet(width=8") and "2 rank(s) on cpu (gloo)" in lines[0]
    assert [line.split()[1] for line in lines[1:6]] == [f"{e}/5" for e in range(1, 6)]
    assert lines[-1].startswith("done: 5 epochs") and "pytorch_res.png" in lines[-1]
    assert "\r" not in result.stdout


def test_picture_of_the_curves(reference_run):
    out, _ = reference_run
    png = out / "pytorch_res.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    import matplotlib.image

    pixels = torch.from_numpy(matplotlib.image.imread(png))[..., :3]
    for name, rgb in {"train loss": (31, 119, 180), "test loss": (255, 127, 14), "accuracy": (44, 160, 44),
                      "learning rate": (148, 103, 189)}.items():
        close = (pixels * 255 - torch.tensor(rgb)).abs().max(dim=-1).values < 12
        assert close.sum() > 50, f"no {name} curve in the picture"


def test_checkpoint_is_plain_and_complete(reference_run):
    out, _ = reference_run
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 5 and len(checkpoint["history"]) == 5
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in checkpoint["model"])
    assert checkpoint["config"]["WIDTH"] == 8 and "state" in checkpoint["optimizer"]


def run_workers(worker, world_size, *args):
    os.environ.pop("MASTER_PORT", None)
    assert dt.run_distribute(worker, world_size, *args) == 0


def test_evaluation_is_exact_and_independent_of_the_world_size(reference_run, tmp_path, own_environment):
    out, _ = reference_run
    argv = TINY + [f"--output_dir={out}"]
    results = []
    for world_size in (1, 2):
        run_workers(workers.evaluate_worker, world_size, argv, str(tmp_path / f"ws{world_size}.json"))
        results.append(json.loads((tmp_path / f"ws{world_size}.json").read_text()))
    assert results[0]["images"] == results[1]["images"] == 400  # every test image, no padding
    assert results[0]["acc"] == results[1]["acc"]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], abs=1e-5)
    # the checkpoint holds the statistics the run evaluated with: the CSV's last figure comes back exactly
    assert results[1]["acc"] == pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]


def test_two_ranks_step_like_one_rank_on_the_whole_batch(tmp_path, own_environment):
    """Proves sharding and gradient averaging: B/2 images on each of 2 ranks == B images on 1 rank."""
    run_workers(workers.gradient_step_worker, 1, 64, str(tmp_path / "one.pt"))
    run_workers(workers.gradient_step_worker, 2, 64, str(tmp_path / "two.pt"))
    one, two = (torch.load(tmp_path / name, weights_only=True) for name in ("one.pt", "two.pt"))
    torch.manual_seed(0)
    initial = workers.nn.Conv2d(3, 8, 3, padding=1).weight
    assert not torch.allclose(one["0.weight"], initial), "the steps changed nothing"
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- runs that reuse an output folder


def test_world_size_1_follows_the_same_lr_shows_progress_and_moves_old_results_aside(reference_run, tmp_path):
    out, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    reference_csv = (out / "pytorch_res.csv").read_text()
    output = run_on_terminal(*TINY, "--world_size=1", "--epochs=5", "--progress_every=2", f"--output_dir={folder}")
    single = pd.read_csv(folder / "pytorch_res.csv")
    assert single["lr"].tolist() == pytest.approx(pd.read_csv(out / "pytorch_res.csv")["lr"].tolist(), rel=1e-12)
    assert "\r" in output and "[####" in output and "img/s" in output and "eta" in output
    previous = list(folder.glob("previous-*"))
    assert len(previous) == 1 and (previous[0] / "pytorch_res.csv").read_text() == reference_csv
    assert (previous[0] / "checkpoint.pt").exists() and (previous[0] / "pytorch_res.png").exists()


def run_on_terminal(*args: str) -> str:
    """Runs the script with stdout on a pseudo-terminal, as in an interactive shell."""
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=follower, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=clean_env())
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closes when the last process holding it exits
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=HANG_TIMEOUT) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_kill_9_then_resume_gives_every_epoch_once_and_the_same_numbers(reference_run, tmp_path):
    out, _ = reference_run
    folder = tmp_path / "out"
    args = [*TINY, "--epochs=5", f"--output_dir={folder}"]
    process = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=clean_env(), start_new_session=True)
    wait_for_rows(folder, 2, process)
    os.killpg(process.pid, signal.SIGKILL)  # the whole run, launcher and ranks, at whatever moment
    process.wait()
    killed_after = csv_rows(folder)
    result = run_script(*args, "--resume=True")
    assert result.returncode == 0, result.stderr
    resumed, reference = pd.read_csv(folder / "pytorch_res.csv"), pd.read_csv(out / "pytorch_res.csv")
    assert resumed["epoch"].tolist() == [1, 2, 3, 4, 5], f"killed after {killed_after} rows"
    assert not list(folder.glob("*.tmp*")), "a temporary file of the killed run is left"
    for column in ("loss", "acc", "test_loss", "lr"):
        assert resumed[column].tolist() == pytest.approx(reference[column].tolist(), abs=1e-5), column


@pytest.mark.parametrize("change", ["--batch_size=128", "--epochs=7", "--width=16", "--lr=0.1"])
def test_resume_refuses_a_different_run(reference_run, change):
    import train_distribute as td

    out, _ = reference_run
    cfg = td.read_config([*TINY, "--epochs=5", f"--output_dir={out}", "--resume=True", change])
    name = change[2:].split("=")[0].upper()
    with pytest.raises(dt.UserError, match=f"{name}=.* differs from the checkpoint's"):
        td.read_resume_checkpoint(cfg)


def test_non_finite_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(reference_run, tmp_path):
    out, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    checkpoint["epoch"], checkpoint["history"] = 2, checkpoint["history"][:2]
    checkpoint["model"]["head.bias"][0] = math.nan  # weights gone bad: epoch 3 cannot have a finite loss
    torch.save(checkpoint, folder / "checkpoint.pt")
    saved = (folder / "checkpoint.pt").read_bytes()
    result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", "--resume=True")
    assert result.returncode != 0
    assert "loss became nan in epoch 3" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (folder / "checkpoint.pt").read_bytes() == saved
    assert csv_rows(folder) == 2


# ----------------------------------------------------------------------------- faults


def start_long_run(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *TINY, "--epochs=500", f"--output_dir={folder}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)


def rank_processes(launcher: int) -> list[int]:
    ranks = [pid for pid in children_of(launcher) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 2, ranks
    return ranks


def stop_run(process: subprocess.Popen, folder: Path, rows: int, stop, limit: float) -> str:
    """Once the run has written `rows` epochs, call stop(); the run must end within `limit` seconds and
    leave no process behind. Returns what it printed on stderr."""
    try:
        wait_for_rows(folder, rows, process)
        descendants = children_of(process.pid)
        stop()
        started = time.monotonic()
        _, err = process.communicate(timeout=limit + 30)
        assert time.monotonic() - started < limit
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    time.sleep(0.5)
    assert not [pid for pid in descendants if alive(pid)], "processes left behind"
    return err


def test_a_killed_rank_ends_the_run_and_leaves_nothing_behind(tmp_path):
    process = start_long_run(tmp_path / "out")
    kill_rank_1 = lambda: os.kill(rank_processes(process.pid)[1], signal.SIGKILL)  # noqa: E731 (as the OOM killer)
    err = stop_run(process, tmp_path / "out", 1, kill_rank_1, limit=60)
    assert process.returncode != 0
    assert "rank 1 was killed by SIGKILL" in err


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    """kill -9 of the launcher alone, started the way a shell starts a background job (SIGINT ignored)."""
    process = subprocess.Popen([sys.executable, str(SCRIPT), *TINY, "--epochs=500", f"--output_dir={tmp_path}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(),
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for_rows(tmp_path, 1, process)
        ranks = rank_processes(process.pid)
        process.kill()
        process.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in ranks), "ranks kept running without their launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_ctrl_c_stops_every_rank_within_seconds_and_keeps_the_files_whole(tmp_path):
    folder = tmp_path / "out"
    process = start_long_run(folder)
    press_ctrl_c = lambda: os.killpg(process.pid, signal.SIGINT)  # noqa: E731 (a terminal signals the whole group)
    err = stop_run(process, folder, 2, press_ctrl_c, limit=20)
    assert process.returncode == 130 and "interrupted" in err and "Traceback" not in err
    rows = csv_rows(folder)
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert rows >= 2 and checkpoint["epoch"] >= rows  # whole files; the CSV trails the checkpoint at most


# ----------------------------------------------------------------------------- torchrun


def test_torchrun_standalone(tmp_path):
    result = subprocess.run(torchrun_command("--standalone", "--nproc_per_node=2", str(SCRIPT),
                                             *TINY[:-1], "--epochs=1", "--world_size=3", f"--output_dir={tmp_path / 'out'}"),
                            capture_output=True, text=True, timeout=HANG_TIMEOUT, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert csv_rows(tmp_path / "out") == 1
    assert "WORLD_SIZE=3 is ignored under torchrun, which started 2 ranks" in result.stdout
    assert "2 rank(s) on cpu (gloo)" in result.stdout


def test_two_torchrun_nodes_meet_and_only_global_rank_0_writes(tmp_path):
    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("--nnodes=2", "--nproc_per_node=1", f"--node_rank={n}",
                                               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                                               "--rdzv_id=test", str(SCRIPT), *TINY[:-1], "--epochs=1",
                                               f"--output_dir={tmp_path / f'out{n}'}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
             for n in (0, 1)]
    logs = [node.communicate(timeout=HANG_TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs
    written = [csv_rows(tmp_path / f"out{n}") for n in (0, 1)]
    assert sorted(written) == [0, 1], written
    empty = tmp_path / f"out{written.index(0)}"
    assert not empty.exists() or not any(empty.iterdir())
