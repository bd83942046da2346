"""End to end: the training script with real processes (2 gloo ranks on the CPU) on tiny generated data."""

import contextlib
import fcntl
import json
import math
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import outputs
import pandas as pd
import processes
import pytest
import resume
import torch
from processes import UserError

from tests.conftest import (
    HANG_TIMEOUT,
    SCRIPT,
    SETTINGS,
    TINY,
    alive,
    call,
    children_of,
    clean_env,
    csv_rows,
    launch,
    model_name,
    needs,
    new_interpreter,
    rank_processes,
    read_config,
    run_script,
    scenario,
    snapshot,
    start_torchrun,
    torchrun_command,
    wait_for_rows,
    width,
)

COLUMNS = list(outputs.COLUMNS)  # the single source: a column added there is checked here too


# ----------------------------------------------------------------------------- one normal run, read many ways


def test_two_ranks_write_one_row_per_epoch_and_learn(reference_run):
    out, _, _ = reference_run
    df = pd.read_csv(out / "pytorch_res.csv")
    assert list(df.columns) == COLUMNS
    assert df["epoch"].tolist() == [1, 2, 3, 4, 5]
    assert df["acc"].between(0, 1).all() and (df["images_per_second"] > 0).all() and (df["lr"] > 0).all()
    assert df["acc"].iloc[-1] > 0.5, "10 classes: chance is 0.1"
    assert df["loss"].iloc[-1] < df["loss"].iloc[0]
    assert df["train_acc"].iloc[-1] > 0.5


def test_clocks_count_the_whole_run(reference_run):
    """elapsed_seconds runs from the launcher's start to each epoch's end of evaluation; epoch_seconds is that
    epoch's training and evaluation only, so the gaps between elapsed values are at least that."""
    out, result, wall_seconds = reference_run
    df = pd.read_csv(out / "pytorch_res.csv")
    elapsed, epoch = df["elapsed_seconds"], df["epoch_seconds"]
    startup = float(result.stdout.split("start-up ")[1].split(" s")[0])  # as the first line reports it
    assert startup > 0 and elapsed.iloc[0] >= startup + epoch.iloc[0] - 0.05  # start-up (spawning, data) counts
    assert (elapsed.diff().iloc[1:] >= epoch.iloc[1:] - 0.01).all()
    assert elapsed.iloc[-1] < wall_seconds  # the process ran longer than its last epoch's clock says
    assert (df["write_wait_seconds"] >= 0).all()


def test_only_rank_0_speaks_in_plain_lines_when_not_on_a_terminal(reference_run):
    _, result, _ = reference_run
    assert result.stderr.strip() == "", result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 + 5 + 1, result.stdout  # what the run is, one line per epoch, the summary
    assert lines[0].startswith(f"{model_name()}(") and "2 rank(s) on cpu (gloo)" in lines[0]
    assert "start-up " in lines[0]
    assert [line.split()[1] for line in lines[1:6]] == [f"{e}/5" for e in range(1, 6)]
    assert lines[-1].startswith("done: 5 epochs") and "pytorch_res.png" in lines[-1]
    assert "\r" not in result.stdout


def test_picture_of_the_curves(reference_run):
    out, _, _ = reference_run
    png = out / "pytorch_res.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    import matplotlib.image

    pixels = torch.from_numpy(matplotlib.image.imread(png))[..., :3]
    for name, rgb in {
        "train loss": (31, 119, 180),
        "test loss": (255, 127, 14),
        "accuracy": (44, 160, 44),
        "learning rate": (148, 103, 189),
    }.items():
        close = (pixels * 255 - torch.tensor(rgb)).abs().max(dim=-1).values < 12
        assert close.sum() > 50, f"no {name} curve in the picture"


def test_checkpoint_is_plain_and_complete(reference_run):
    out, _, _ = reference_run
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 5 and len(checkpoint["history"]) == 5
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in checkpoint["model"])
    assert checkpoint["config"]["BATCH_SIZE"] == 48 and "state" in checkpoint["optimizer"]
    recorded = checkpoint["data"]  # what an evaluation of the weights needs, and what a resume checks
    assert recorded["classes"] == [f"class_{c}" for c in range(10)] and recorded["image_size"] == 32
    assert len(recorded["mean"]) == 3 and recorded["identity"].startswith("600 train and 120 test images of 32x32")


def test_evaluation_is_exact_and_independent_of_the_world_size(reference_run, tmp_path):
    out, _, _ = reference_run
    argv = [*TINY, f"--output_dir={out}"]
    results = []
    for world_size in (1, 2):
        path = tmp_path / f"ws{world_size}.json"
        assert call("tests.workers:start", "evaluate_worker", world_size, argv, str(path)).returncode == 0
        results.append(json.loads(path.read_text()))
    assert results[0]["images"] == results[1]["images"] == 120  # every test image, no padding
    assert results[0]["acc"] == results[1]["acc"]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], abs=1e-5)
    # the checkpoint holds the statistics the run evaluated with: the CSV's last figure comes back exactly
    assert results[1]["acc"] == pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]


# ----------------------------------------------------------------------------- how a run ends


def finished_run_scenario() -> tuple:
    """A run as a user starts it, its ranks spawned, with Ctrl-C to the whole run as soon as it prints its summary;
    each rank's own exit code and the threads each rank had left are recorded (tests/exit_codes.py)."""
    out = Path(tempfile.mkdtemp(prefix="finished-run-"))
    command = [sys.executable, "-m", "tests.exit_codes", *TINY, "--epochs=1", f"--output_dir={out / 'out'}"]
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "env": clean_env(EXIT_CODES_DIR=str(out))}
    with new_interpreter(command, **options) as process:
        lines = []
        for line in process.stdout:  # as soon as the summary is printed, Ctrl-C reaches every process of the run
            lines.append(line)
            if line.startswith("done:"):
                os.killpg(process.pid, signal.SIGINT)
        err = process.stderr.read()
        code = process.wait(timeout=HANG_TIMEOUT)
    codes = json.loads((out / "codes.json").read_text()) if (out / "codes.json").exists() else None
    threads = [
        json.loads((out / f"threads{r}.json").read_text()) for r in (0, 1) if (out / f"threads{r}.json").exists()
    ]
    return code, err, lines, codes, threads


@needs((finished_run_scenario,))
def test_each_rank_process_exits_0_and_leaves_no_group_thread_behind():
    """A whole run with its ranks spawned (a new interpreter each, torn down as at any exit): each rank process's
    own exit code is 0, and no thread of the process group outlives it (such a thread, freeing a tensor while
    the interpreter finalized, aborted finished runs: "terminate called without an active exception")."""
    code, err, _, codes, threads = scenario(finished_run_scenario)
    assert code == 0 and "terminate called" not in err, err
    assert codes == {"0": 0, "1": 0} and len(threads) == 2
    for names in threads:
        assert not [name for name in names if "gloo" in name or "pt_" in name], names


@needs((finished_run_scenario,))
def test_ctrl_c_just_after_the_run_finished_changes_nothing():
    """A signal after every file is written: the run still exits 0, no rank is reported killed."""
    code, err, lines, codes, _ = scenario(finished_run_scenario)
    assert code == 0 and codes == {"0": 0, "1": 0}, err
    assert err.strip() == "" and any(line.startswith("done:") for line in lines)


def ctrl_c_while_starting_scenario(real: bool) -> tuple:
    """Ctrl-C as soon as both ranks exist: spawned by a new interpreter (they are importing torch), or forked from
    the test server (they are joining the group)."""
    folder = Path(tempfile.mkdtemp(prefix="ctrl-c-start-")) / "out"
    args = [*TINY, "--epochs=3", f"--output_dir={folder}"]
    real_run = new_interpreter([sys.executable, str(SCRIPT), *args], stderr=subprocess.PIPE, env=clean_env())
    with real_run if real else contextlib.nullcontext(launch(*args)) as process:
        deadline = time.monotonic() + 60
        while len(starting_ranks(process.pid)) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        os.killpg(process.pid, signal.SIGINT)
        # under the launcher's grace: a rank that does not end by itself (it is killed then) is a hang here
        _, err = process.communicate(timeout=processes.GRACE_SECONDS - 5)
    return process.returncode, err, (folder / "checkpoint.pt").exists()


def starting_ranks(pid: int) -> list[int]:
    """The launcher's processes that are not multiprocessing's resource tracker: the ranks as they start."""
    ranks = []
    for child in children_of(pid):
        try:
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                ranks.append(child)
        except OSError:  # gone between the listing and the read: a short-lived helper, not a rank
            continue
    return ranks


@needs((ctrl_c_while_starting_scenario, True))
@pytest.mark.parametrize("while_the_ranks", ["import_torch", "join_the_group"])
def test_ctrl_c_while_the_ranks_start_is_one_line(while_the_ranks):
    """Ctrl-C while the ranks import torch or join the group: no traceback, exit 130, nothing written."""
    code, err, checkpoint = scenario(ctrl_c_while_starting_scenario, while_the_ranks == "import_torch")
    assert code == processes.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "TCPStore" not in err and len(err.strip().splitlines()) <= 1, err
    assert all(line.startswith("interrupted: ") for line in err.strip().splitlines())
    assert not checkpoint


# ----------------------------------------------------------------------------- one optimizer step, compared


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict:
    """One optimizer step of the project's code from the same start in several variants, at world size 1 and 2 (one
    process group each): {"ws1": {variant: tensors}, "ws2": {...}}."""
    tmp = tmp_path_factory.mktemp("steps")
    variants = {
        1: {"bn": ([], False), "no_bn": ([], True)},
        2: {
            "bn": ([], False),
            "no_bn": ([], True),
            "accumulate": (["--accumulate=2"], False),
            "no_bn_accumulate": (["--accumulate=2"], True),
        },
    }
    results = {}
    for world_size, chosen in variants.items():
        out = str(tmp / f"ws{world_size}.pt")
        assert call("tests.workers:start", "steps_worker", world_size, chosen, 256, out).returncode == 0
        results[f"ws{world_size}"] = torch.load(out, weights_only=True)
    return results


def gradient_difference(a: dict, b: dict) -> float:
    """|a - b| / |b| over every parameter's gradient at once."""
    names = [k for k in b if k.startswith("grad.")]
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in names).sqrt() / sum((b[k] ** 2).sum() for k in names).sqrt())


def test_two_ranks_step_like_one_rank_on_the_whole_batch(steps):
    """Sharding and gradient averaging: 128 images on each of 2 ranks == 256 on 1 (a network without BatchNorm,
    whose result does not depend on how the batch is split)."""
    one, two = steps["ws1"]["no_bn"], steps["ws2"]["no_bn"]
    assert gradient_difference(two, one) < 1e-4  # float rounding: the sums run in another order
    for name in (k for k in one if not k.startswith("grad.")):
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)


def test_batchnorm_normalises_each_ranks_share(steps):
    """With BatchNorm each rank normalises by its own 128 images: 2 x 128 does not step like 1 x 256. The gap is
    far above float rounding (below 1e-4, the test above): 0.080 measured for the ResNet at width 4, 0.016 for the
    small CNN of tests/swap_network.py."""
    one, plain = steps["ws1"]["bn"], steps["ws2"]["bn"]
    assert gradient_difference(plain, one) > 1e-3


def test_accumulation_steps_like_the_whole_share(steps):
    """ACCUMULATE=2 splits each rank's 128 images into 2 x 64 with one all-reduce. Without BatchNorm the gradients
    equal one step of 128 (1e-4: float rounding). With BatchNorm in training mode they are close, not equal: each
    micro-batch is normalised by its own 64 images' statistics, so the function itself differs; measured 0.10
    relative difference at width 4 (tolerance 0.25, against 1.0 for unrelated gradients)."""
    ws2 = steps["ws2"]
    assert gradient_difference(ws2["no_bn_accumulate"], ws2["no_bn"]) < 1e-4
    assert 0 < gradient_difference(ws2["accumulate"], ws2["bn"]) < 0.25


# ----------------------------------------------------------------------------- runs that reuse an output folder


def test_world_size_1_follows_the_same_lr_shows_progress_and_moves_old_results_aside(reference_run, tmp_path):
    out, _, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    reference_csv = (out / "pytorch_res.csv").read_text()
    output = run_on_terminal(*TINY, "--world_size=1", "--epochs=5", "--progress_every=2", f"--output_dir={folder}")
    single = pd.read_csv(folder / "pytorch_res.csv")
    assert single["lr"].tolist() == pytest.approx(pd.read_csv(out / "pytorch_res.csv")["lr"].tolist(), rel=1e-12)
    assert "epoch 1/5:" in output and "step/s" in output and "img/s]" in output  # the bar, with its loss and speed
    previous = list(folder.glob("previous-*"))
    assert len(previous) == 1 and (previous[0] / "pytorch_res.csv").read_text() == reference_csv
    assert (previous[0] / "checkpoint.pt").exists() and (previous[0] / "pytorch_res.png").exists()
    assert f"moved the earlier run's results in {folder} to {previous[0]}" in output


def run_on_terminal(*args: str, interrupt_at: str = "", exit_code: int = 0) -> str:
    """Runs the script with stdout on a pseudo-terminal, as in an interactive shell; with `interrupt_at`, Ctrl-C
    as soon as that text shows."""
    import select

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns: room for a bar
    process = launch(*args, output=os.ttyname(follower))  # the test holds the terminal open until the run ends
    chunks = []
    while process.poll() is None or select.select([leader], [], [], 0)[0]:
        if select.select([leader], [], [], 0.1)[0]:
            chunks.append(os.read(leader, 65536))
        if interrupt_at and interrupt_at in b"".join(chunks).decode(errors="replace"):
            os.killpg(process.pid, signal.SIGINT)  # as the terminal sends it: to every process of the run
            interrupt_at = ""
    os.close(follower)
    os.close(leader)
    assert process.wait(timeout=HANG_TIMEOUT) == exit_code, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def run_args(loader: str, request) -> list[str]:
    """TINY, or its counterpart on the stream loader (an image folder read by DataLoader workers)."""
    return TINY if loader == "memory" else request.getfixturevalue("tiny_stream")


@pytest.fixture(scope="module")
def stream_reference_run(tiny_stream, tmp_path_factory) -> Path:
    """reference_run's counterpart on the stream loader, of 3 epochs."""
    out = tmp_path_factory.mktemp("stream-reference") / "out"
    result = run_script(*tiny_stream, "--epochs=3", f"--output_dir={out}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(300 train, 60 test images, 2 other files or folders skipped) | loader stream, 1 worker(s) per rank | " in (
        result.stdout
    )
    return out


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_ctrl_c_on_a_terminal_mid_epoch_clears_the_progress_bar_before_the_last_line(tmp_path, loader, request):
    args = ["--progress_every=1", f"--output_dir={tmp_path}", "--epochs=50"]
    output = run_on_terminal(*run_args(loader, request), *args, interrupt_at="epoch 2/50:", exit_code=130)
    bar_left, _, line = output.rpartition("interrupted: ")
    assert line.startswith(f"the files in {tmp_path} are from epoch ") and "step" in bar_left
    assert re.split(r"[\r\n]", bar_left)[-1].strip() == "", "the line starts after a half-drawn bar"


def resume_and_check(folder: Path, reference: Path, args: list) -> subprocess.CompletedProcess:
    """Resume the run in folder: it must end with every epoch exactly once and the uninterrupted run's numbers."""
    result = run_script(*args, "--resume=True")
    assert result.returncode == 0, result.stderr
    resumed, expected = pd.read_csv(folder / "pytorch_res.csv"), pd.read_csv(reference / "pytorch_res.csv")
    assert resumed["epoch"].tolist() == list(range(1, len(expected) + 1))
    assert not list(folder.glob("*.tmp*")), "a temporary file of the killed run is left"
    for column in ("loss", "acc", "test_loss", "lr"):
        assert resumed[column].tolist() == pytest.approx(expected[column].tolist(), abs=1e-5), column
    assert resumed["elapsed_seconds"].is_monotonic_increasing  # the clock goes on from the checkpoint's
    return result


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_kill_9_then_resume_gives_every_epoch_once_and_the_same_numbers(reference_run, tmp_path, loader, request):
    """On the stream loader too: a resumed run draws the data in the uninterrupted run's order."""
    out = reference_run[0] if loader == "memory" else request.getfixturevalue("stream_reference_run")
    folder, epochs = tmp_path / "out", 5 if loader == "memory" else 3
    args = [*run_args(loader, request), f"--epochs={epochs}", f"--output_dir={folder}"]
    process = launch(*args)
    wait_for_rows(folder, epochs // 2, process)
    os.killpg(process.pid, signal.SIGKILL)  # the whole run, launcher and ranks, at whatever moment
    process.wait()
    done = torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"]
    result = resume_and_check(folder, out, args)
    assert f"resuming after epoch {done} of {epochs}" in result.stdout
    assert f"done: {epochs} epochs in " in result.stdout


def test_kill_9_during_a_background_write_loses_only_that_epoch(reference_run, tmp_path):
    out, _, _ = reference_run
    folder, marker = tmp_path / "out", tmp_path / "writing"
    args = [*TINY, "--epochs=5", f"--output_dir={folder}"]
    process = launch(*args, env=clean_env(TEST_SLOW_EPOCH="2", TEST_MARKER=str(marker)))
    deadline = time.monotonic() + HANG_TIMEOUT
    while not marker.exists():  # epoch 2's checkpoint is being written, in the background
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == 1 and csv_rows(folder) == 1
    resume_and_check(folder, out, args)


def copy_stopped_after(out: Path, folder: Path, epoch: int) -> dict:
    """The reference run's files copied to `folder`, and its checkpoint as if the run had stopped after `epoch`
    (for the test to change and save)."""
    shutil.copytree(out, folder)
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    checkpoint["epoch"], checkpoint["history"] = epoch, checkpoint["history"][:epoch]
    return checkpoint


def test_a_resume_continues_a_checkpoint_saved_before_a_column_and_a_setting_existed(reference_run, tmp_path):
    """A checkpoint whose rows lack a column the code now writes: the resume works, earlier rows get an empty
    cell."""
    folder = tmp_path / "out"
    checkpoint = copy_stopped_after(reference_run[0], folder, epoch=3)
    newest = COLUMNS[-1]  # as if this column and the last setting were added after the checkpoint was written
    checkpoint["history"] = [{k: v for k, v in row.items() if k != newest} for row in checkpoint["history"]]
    del checkpoint["config"][list(SETTINGS)[-1]]
    torch.save(checkpoint, folder / "checkpoint.pt")
    result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", "--resume=True")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    df = pd.read_csv(folder / "pytorch_res.csv")
    assert df["epoch"].tolist() == [1, 2, 3, 4, 5] and list(df.columns) == COLUMNS
    assert df[newest].isna().tolist() == [True, True, True, False, False]


def test_a_column_added_in_one_place_reaches_the_csv_and_the_checkpoint(tmp_path):
    """A COLUMNS entry and the row's value (here a numpy number, which the row turns into a plain one)."""
    added = clean_env(TEST_NEW_COLUMN="half_epoch", TEST_ROW_KEY="half_epoch")
    result = run_script(*TINY, "--epochs=2", f"--output_dir={tmp_path}", env=added)
    assert result.returncode == 0, result.stderr
    df = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert list(df.columns) == [*COLUMNS, "half_epoch"] and df["half_epoch"].tolist() == [0.5, 1.0]
    history = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["history"]
    assert [row["half_epoch"] for row in history] == [0.5, 1.0]


def test_a_row_value_that_is_no_column_stops_every_rank_at_epoch_1_in_one_line(tmp_path):
    folder = tmp_path / "out"
    result = run_script(*TINY, "--epochs=2", f"--output_dir={folder}", env=clean_env(TEST_ROW_KEY="surprise"))
    assert result.returncode == processes.EXIT_USER_ERROR and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the row's 'surprise' is not in outputs.COLUMNS; add it there, or leave it out of the row"
    ]
    assert not any((folder / name).exists() for name in outputs.RESULT_FILES)


def test_a_network_with_parameters_that_no_step_uses_is_one_line_naming_the_fix(tmp_path):
    result = run_script(*TINY, "--epochs=1", f"--output_dir={tmp_path}", env=clean_env(TEST_UNUSED_LAYER="1"))
    assert result.returncode == processes.EXIT_USER_ERROR and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the network has parameters that no training step uses (")
    assert "find_unused_parameters=True" in lines[0] and not (tmp_path / "checkpoint.pt").exists()


def test_a_checkpoint_of_another_network_is_refused_in_one_line_before_training(reference_run, tmp_path):
    out, _, _ = reference_run
    folder = tmp_path / "out"
    checkpoint = copy_stopped_after(out, folder, epoch=2)
    first = next(iter(checkpoint["model"]))
    checkpoint["model"][first] = torch.zeros(1)  # as written by another network
    torch.save(checkpoint, folder / "checkpoint.pt")
    before = snapshot(folder)
    result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", "--resume=True")
    assert result.returncode == processes.EXIT_USER_ERROR and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: the checkpoint in {folder} is of another network: its {first} is (1,), this network's "
        f"{tuple(torch.load(out / 'checkpoint.pt', weights_only=True)['model'][first].shape)}; resume with the "
        "network that wrote it, or start a new run in another --output_dir"
    ]
    assert {p: v for p, v in snapshot(folder).items() if p != ".lock"} == {
        p: v for p, v in before.items() if p != ".lock"
    }


def test_a_failed_write_ends_the_run_with_one_line_and_keeps_the_last_files(tmp_path):
    folder = tmp_path / "out"
    process = launch(*TINY, "--epochs=5", f"--output_dir={folder}", env=clean_env(TEST_FAIL_EPOCH="2"))
    _, err = process.communicate(timeout=HANG_TIMEOUT)
    assert process.returncode == processes.EXIT_USER_ERROR and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: could not write {folder}/checkpoint.pt (No space left on device); free space or choose another "
        f"--output_dir, then continue with --resume True (the checkpoint of epoch 1 is kept)"
    ]
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == 1 and csv_rows(folder) == 1


def test_a_bug_in_the_writer_is_one_line_on_every_rank_too(tmp_path):
    """A ValueError in the writer thread (not a disk problem) once escaped as a traceback while the others waited."""
    folder = tmp_path / "out"
    process = launch(*TINY, "--epochs=5", f"--output_dir={folder}", env=clean_env(TEST_WRITE_BUG_EPOCH="2"))
    _, err = process.communicate(timeout=HANG_TIMEOUT)
    assert process.returncode == processes.EXIT_USER_ERROR and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not write the files in") and "ValueError" in lines[0]
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == 2 and csv_rows(folder) == 1


@pytest.mark.parametrize("how", ["resume", "slurm_requeue", "torchrun_under_slurm"])
def test_a_finished_run_started_again_changes_nothing_and_exits_0(reference_run, tmp_path, how):
    """A requeue that lands after the last epoch, or a --resume of a finished run: one line, exit 0 within 30 s,
    and nothing in OUTPUT_DIR is created or changed, .lock included. torchrun --standalone gives every start a new
    run id; a requeued job's restart count says it is the same job."""
    out, _, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    before, started = snapshot(folder), time.monotonic()
    args = [*TINY, "--epochs=5", f"--output_dir={folder}"]
    env = clean_env(SLURM_RESTART_COUNT="1", SLURM_JOB_ID="77")
    if how == "resume":
        result = run_script(*args, "--resume=True")
    elif how == "slurm_requeue":
        result = run_script(*args, env=env)
    else:
        torchrun = ["--run-path", "--start-method=fork", "--standalone", "--nproc_per_node=2", str(SCRIPT), *args]
        run = launch(*torchrun, module="torch.distributed.run", env=env)
        result = subprocess.CompletedProcess(args, run.wait(timeout=HANG_TIMEOUT), *run.communicate())
    line = f"already finished: all 5 epochs are in {folder}; nothing to do"
    assert result.returncode == 0 and result.stdout.strip().splitlines() == [line], result.stdout + result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - started < 30
    assert snapshot(folder) == before


def test_a_restart_that_cannot_read_its_checkpoint_says_so_and_never_starts_over(reference_run, tmp_path):
    """A requeued job whose checkpoint.pt was cut short once moved it aside and trained from epoch 1 in silence."""
    out, _, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    checkpoint = folder / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:5000])
    before = snapshot(folder)
    result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", env=clean_env(SLURM_RESTART_COUNT="1"))
    assert result.returncode == processes.EXIT_USER_ERROR and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot read {checkpoint} ("), lines
    assert "move it away to start the run over" in lines[0] and "epoch 1/" not in result.stdout
    assert {p: v for p, v in snapshot(folder).items() if p != ".lock"} == {
        p: v for p, v in before.items() if p != ".lock"
    }


@pytest.mark.parametrize("change", ["--batch_size=64", "--epochs=7", "--momentum=0.8", "--lr=0.1"])
def test_resume_refuses_a_different_run(reference_run, change):
    out, _, _ = reference_run
    cfg = read_config([*TINY, "--epochs=5", f"--output_dir={out}", "--resume=True", change])
    name = change[2:].split("=")[0].upper()
    with pytest.raises(UserError, match=f"{name}=.* differs from the checkpoint's"):
        resume.check_before_start(cfg)


def image_folder_of(root: Path, seed: int, sizes: tuple = (32,)) -> None:
    """Two classes of eight small images each, in train/ and test/: pixels drawn from `seed`; sizes in turn."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    for split, count in (("train", 8), ("test", 2)):
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                size = sizes[i % len(sizes)]
                pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / label / f"{i}.png")


def test_a_resume_on_other_images_of_the_same_count_and_classes_is_refused(tmp_path):
    """Other files: the same names, other sizes (an image folder is told apart by its files' names and sizes)."""
    for name, seed, size in (("a", 0, 32), ("b", 1, 40)):
        image_folder_of(tmp_path / name, seed, sizes=(size,))
    common = ["--dataset=imagefolder", *width(4), "--batch_size=4", "--epochs=2", f"--output_dir={tmp_path / 'out'}"]
    first = run_script(*common, f"--data_dir={tmp_path / 'a'}", "--epochs=2")
    assert first.returncode == 0, first.stderr
    saved = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)  # as if stopped after epoch 1 of 2
    saved.update(epoch=1, history=saved["history"][:1])
    torch.save(saved, tmp_path / "out" / "checkpoint.pt")
    kept = (tmp_path / "out" / "checkpoint.pt").read_bytes()
    second = run_script(*common, f"--data_dir={tmp_path / 'b'}", "--resume=True")
    assert second.returncode == processes.EXIT_USER_ERROR and "Traceback" not in second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "was trained on other data (16 train and 4 test images of 32x32, files " in lines[0]
    assert "resume on the same data" in lines[0] and (tmp_path / "out" / "checkpoint.pt").read_bytes() == kept


def test_a_run_at_64x64_trains_at_64x64(tmp_path):
    image_folder_of(tmp_path / "images", seed=0, sizes=(64, 48))  # half the images must be resized
    folder = tmp_path / "out"
    args = ["--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", "--image_size=64", *width(4)]
    result = run_script(*args, "--batch_size=4", "--epochs=1", f"--output_dir={folder}")
    assert result.returncode == 0, result.stderr
    first_line = result.stdout.splitlines()[0]
    assert "(16 train, 4 test images, 10 resized to 64x64) | loader memory (auto: " in first_line
    assert "GB free per rank, within 25% of the free memory) | " in first_line
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert checkpoint["data"]["image_size"] == 64 and checkpoint["data"]["identity"].find("of 64x64") > 0
    cache = next((tmp_path / "images" / ".decoded").glob("train-*.pt"))
    assert torch.load(cache, weights_only=True)["images"].shape == (16, 3, 64, 64)


def test_master_port_0_picks_a_free_port(tmp_path):
    result = run_script(*TINY, "--epochs=1", f"--output_dir={tmp_path}", env=clean_env(MASTER_PORT="0"))
    assert result.returncode == 0 and csv_rows(tmp_path) == 1, result.stderr


def test_non_finite_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(reference_run, tmp_path):
    folder = tmp_path / "out"
    checkpoint = copy_stopped_after(reference_run[0], folder, epoch=2)
    first_weights = next(t for t in checkpoint["model"].values() if t.is_floating_point())
    first_weights[(0,) * first_weights.dim()] = math.nan  # weights gone bad: epoch 3 cannot have a finite loss
    torch.save(checkpoint, folder / "checkpoint.pt")
    saved = (folder / "checkpoint.pt").read_bytes()
    result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", "--resume=True")
    assert result.returncode != 0
    assert "loss became nan in epoch 3" in result.stderr and "kept the checkpoint of epoch 2" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (folder / "checkpoint.pt").read_bytes() == saved
    assert csv_rows(folder) == 2


def test_two_runs_never_share_an_output_folder(tmp_path):
    folder = tmp_path / "same"
    first = launch(*TINY, "--epochs=500", f"--output_dir={folder}")
    try:
        wait_for_rows(folder, 1, first)
        second = run_script(*TINY, "--epochs=1", "--seed=1", f"--output_dir={folder}")
        assert second.returncode != 0 and "Traceback" not in second.stderr and second.stdout == ""
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"OUTPUT_DIR {folder} is in use by another run" in lines[0]
        assert not list(folder.glob("previous-*")), "the second run moved the first one's files"
        rows = csv_rows(folder)
        wait_for_rows(folder, rows + 1, first)  # the first goes on undisturbed
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


# ----------------------------------------------------------------------------- faults and signals


def stop_run(process, folder: Path, rows: int, stop, limit: float) -> str:
    """Once the run has written `rows` epochs, call stop(); the run must end within `limit` seconds and leave no
    process behind. Returns what it printed on stderr."""
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
    deadline = time.monotonic() + 0.5
    while [pid for pid in descendants if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [pid for pid in descendants if alive(pid)], "processes left behind"
    return err


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_a_killed_rank_ends_the_run_naming_the_kept_epoch_and_leaves_nothing_behind(tmp_path, loader, request):
    """With the stream loader, its DataLoader workers go too (stop_run)."""
    folder = tmp_path / "out"
    process = launch(*run_args(loader, request), "--epochs=500", f"--output_dir={folder}")
    err = stop_run(process, folder, 1, lambda: os.kill(rank_processes(process.pid)[1], signal.SIGKILL), 60)
    kept = torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"]
    assert process.returncode == 1 and "Traceback" not in err and kept == csv_rows(folder) >= 1
    assert err.strip().splitlines()[-1] == (
        "error: rank 1 was killed by SIGKILL (the out-of-memory killer sends SIGKILL: see `dmesg`); stopped the "
        f"other ranks; the files in {folder} are from epoch {kept}: continue with --resume True"
    )


def test_a_rank_that_fails_before_training_says_which_run_the_files_are_from(reference_run, tmp_path):
    """The launcher's line after a rank's bug: an earlier run's files that a new run had yet to move aside are no
    epoch of it; a resumed run's are."""
    folder = tmp_path / "out"
    torch.save(copy_stopped_after(reference_run[0], folder, epoch=3), folder / "checkpoint.pt")
    results = lambda: {k: v for k, v in snapshot(folder).items() if k != ".lock"}  # noqa: E731
    before = results()
    for resumes, kept in (("False", "no epoch had finished, so there is nothing to resume; start the run again"),
                         ("True", f"the files in {folder} are from epoch 3: continue with --resume True")):  # fmt: skip
        result = run_script(*TINY, "--epochs=5", f"--output_dir={folder}", f"--resume={resumes}",
                            env=clean_env(TEST_RANK_1_BUG="1"))  # fmt: skip
        assert result.returncode == 1 and "[rank 1] RuntimeError: a bug in rank 1" in result.stderr
        assert (
            result.stderr.strip().splitlines()[-1]
            == f"error: rank 1 exited with code 1; stopped the other ranks; {kept}"
        )
        assert results() == before  # the lock file aside


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    """kill -9 of the launcher alone, started the way a shell starts a background job (SIGINT ignored)."""
    process = launch(*TINY, "--epochs=500", f"--output_dir={tmp_path}", ignore_sigint=True)
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


def test_ctrl_c_during_a_background_write_finishes_the_files_first(tmp_path):
    folder, marker = tmp_path / "out", tmp_path / "writing"
    process = launch(*TINY, "--epochs=500", f"--output_dir={folder}", env=clean_env(TEST_SLOW_EPOCH="2",
                     TEST_MARKER=str(marker)))  # fmt: skip
    wait_for_rows(folder, 1, process)
    while not marker.exists():
        assert process.poll() is None
        time.sleep(0.05)
    err = stop_run(process, folder, 1, lambda: os.killpg(process.pid, signal.SIGINT), limit=25)
    assert process.returncode == 130 and "interrupted" in err and "Traceback" not in err
    kept = torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"]
    assert kept >= 2 <= csv_rows(folder) and (folder / "pytorch_res.png").exists()
    assert err.strip().splitlines() == [
        f"interrupted: the files in {folder} are from epoch {kept}: continue with --resume True"
    ]


@pytest.mark.parametrize("who,loader", [("launcher", "memory"), ("rank", "memory"), ("job", "stream")])
def test_a_stop_signal_ends_every_rank_resumably(tmp_path, who, loader, request):
    """SIGTERM to the launcher (kill), SIGUSR1 to one rank (SLURM's warning before the time limit) or SIGTERM to
    every process of the run (scancel), DataLoader workers included: every rank stops within seconds, the last
    checkpoint stays, the exit code says "resumable"."""
    folder = tmp_path / "out"
    process = launch(*run_args(loader, request), "--epochs=50", f"--output_dir={folder}")
    if who == "launcher":
        signal_it = lambda: os.kill(process.pid, signal.SIGTERM)  # noqa: E731
    elif who == "job":
        signal_it = lambda: os.killpg(process.pid, signal.SIGTERM)  # noqa: E731
    else:
        signal_it = lambda: os.kill(rank_processes(process.pid)[1], signal.SIGUSR1)  # noqa: E731
    err = stop_run(process, folder, 1, signal_it, limit=25)
    assert process.returncode == processes.EXIT_PREEMPTED == 75, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped by") and lines[0].endswith("continue with --resume True")
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)  # whole, and the CSV agrees with it
    assert checkpoint["epoch"] == csv_rows(folder) >= 1 and not list(folder.glob("*.tmp*"))


# ----------------------------------------------------------------------------- torchrun


def torchrun_standalone_scenario() -> tuple:
    out = Path(tempfile.mkdtemp(prefix="torchrun-")) / "out"
    command = ["--standalone", "--nproc_per_node=2", str(SCRIPT), *TINY[:-1], "--epochs=1", "--world_size=3"]
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "env": clean_env()}
    with new_interpreter(torchrun_command(*command, f"--output_dir={out}"), **options) as process:
        result = subprocess.CompletedProcess(command, process.wait(timeout=HANG_TIMEOUT), *process.communicate())
    return result, csv_rows(out)


@needs((torchrun_standalone_scenario,))
def test_torchrun_standalone():
    """As a user starts it (real interpreters): the workers exit 0, and so does torchrun."""
    result, rows = scenario(torchrun_standalone_scenario)
    assert result.returncode == 0, result.stdout + result.stderr
    assert rows == 1
    assert "WORLD_SIZE=3 is ignored under torchrun, which started 2 ranks" in result.stdout
    assert "2 rank(s) on cpu (gloo)" in result.stdout
    assert "terminate called" not in result.stderr and "Traceback" not in result.stderr


def torchrun_mistake_scenario(mistake: str, nproc: int, restarts: int) -> tuple:
    """A mistake under torchrun with up to `restarts` restarts."""
    from tests.test_bad_input import make_bad_inputs

    tmp_path = Path(tempfile.mkdtemp(prefix="torchrun-mistake-"))
    make_bad_inputs(tmp_path)
    args = {
        "setting": ["--epoch=3"],
        "setting_without_restarts": ["--epochs=0"],
        "unsplittable_batch": ["--batch_size=64"],
        "damaged_image": ["--dataset=imagefolder", f"--data_dir={tmp_path / 'truncated'}", "--batch_size=2"],
    }[mistake]
    command = ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", str(SCRIPT)]
    job = start_torchrun(*command, *TINY[:-1], *args, "--output_dir=out", cwd=tmp_path)
    output = job.communicate(timeout=HANG_TIMEOUT)[0]  # stdout and stderr together
    return job.returncode, output, (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "mistake,nproc,restarts",
    [("setting", 2, 2), ("unsplittable_batch", 3, 2), ("damaged_image", 2, 2), ("setting_without_restarts", 2, 0)],
)
def test_a_mistake_under_torchrun_is_one_line_and_not_restarted(mistake, nproc, restarts):
    """A bad setting (found before the worker trains) or a damaged image (found by the worker): the worker's one
    line comes first and only once, torchrun's own report follows (it cannot be silenced: README) and points at it,
    and torchrun does not restart a run that would fail the same way."""
    code, output, written = scenario(torchrun_mistake_scenario, mistake, nproc, restarts)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code != 0
    assert len(errors) == 1, output  # once: one machine, and no restart
    expected = {
        "setting": "unknown setting --epoch; did you mean --epochs?",
        "setting_without_restarts": "EPOCHS=0 must be positive",
        "unsplittable_batch": "BATCH_SIZE=64 does not split evenly over 3 ranks",
        "damaged_image": "cut.jpg (image file is truncated",
    }[mistake]
    assert expected in errors[0]
    assert output.count(expected) == 1, output  # torchrun's report points at it instead of repeating it
    assert output.index(errors[0]) < output.find("Traceback") or "Traceback" not in output
    assert code == 1  # torchrun's own exit code for any failed worker (README's exit-code table)
    if restarts == 0:  # torchrun's report names our line as the root cause
        assert processes.TORCHRUN_REPORT in output and "ChildFailedError" in output
    assert not written


def test_a_worker_with_a_mistake_asks_torchrun_again_until_it_stops(tmp_path):
    """A SIGTERM that lands while torchrun forks a worker is lost (Python ignores the exception it raises there):
    without another, torchrun took the worker's exit for a failure and restarted the run."""
    out = tmp_path / "facts.json"
    assert call("tests.workers:torchrun_that_drops_a_sigterm", str(out)).returncode == 0
    facts = json.loads(out.read_text())
    assert facts == {"sigterms": 2, "worker_alive": True, "worker_end": -signal.SIGTERM}


def two_nodes(tmp_path: Path, port: int, args_per_node: list, rdzv: str = "c10d", restarts: int = 0) -> list:
    """Two torchrun launchers as two "machines" of one worker each, meeting by c10d rendezvous (ranks in the order
    they arrive) or static rendezvous (node 0 holds rank 0). Each gets a core of its own, as a machine would."""
    rendezvous = (
        ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test"]
        if rdzv == "c10d"
        else ["--master_addr=127.0.0.1", f"--master_port={port}"]
    )
    cores = sorted(os.sched_getaffinity(0))
    nodes = []
    for n, args in enumerate(args_per_node):
        command = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={n}", f"--max-restarts={restarts}", *rendezvous]
        nodes.append(start_torchrun(*command, str(SCRIPT), *args, cpus=[cores[n % len(cores)]]))
    return nodes


def test_two_torchrun_nodes_meet_and_only_global_rank_0_writes(tmp_path):
    from tests.conftest import free_port

    nodes = two_nodes(
        tmp_path, free_port(), [[*TINY[:-1], "--epochs=1", f"--output_dir={tmp_path / f'out{n}'}"] for n in (0, 1)]
    )
    logs = [node.communicate(timeout=HANG_TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs
    written = [csv_rows(tmp_path / f"out{n}") for n in (0, 1)]
    assert sorted(written) == [0, 1], written
    empty = tmp_path / f"out{written.index(0)}"
    assert not empty.exists() or not any(empty.iterdir())
    # Started again (a late requeue, or --resume): the machine whose disk holds the finished run decides for both.
    before = snapshot(tmp_path)
    nodes = two_nodes(
        tmp_path,
        free_port(),
        [[*TINY[:-1], "--epochs=1", f"--output_dir={tmp_path / f'out{n}'}", "--resume=True"] for n in (0, 1)],
    )
    logs = [node.communicate(timeout=HANG_TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs
    assert "".join(logs).count("already finished: all 1 epochs are in ") == 1 and "epoch 1/1" not in "".join(logs)
    assert snapshot(tmp_path) == before


def test_machines_with_other_data_stop_at_once_naming_the_ranks(tmp_path):
    from tests.conftest import free_port
    from tests.test_bad_input import image_folder

    image_folder(tmp_path / "a", {"train/cat": 6, "train/dog": 6, "test/cat": 2, "test/dog": 2})
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "train" / "dog" / "5.jpg").write_bytes((tmp_path / "a" / "train" / "cat" / "0.jpg").read_bytes())
    common = ["--dataset=imagefolder", *width(4), "--batch_size=4", "--epochs=1", "--collective_timeout=300"]
    nodes = two_nodes(
        tmp_path,
        free_port(),
        [[*common, f"--data_dir={tmp_path / d}", f"--output_dir={tmp_path / d}-out"] for d in "ab"],
        rdzv="static",
    )
    started = time.monotonic()
    logs = "".join(node.communicate(timeout=HANG_TIMEOUT)[0] for node in nodes)
    assert time.monotonic() - started < 120, "the mismatch waited for the collective timeout"
    assert all(node.returncode != 0 for node in nodes)
    assert "rank(s) 1 loaded other data than rank 0" in logs and "same copy of DATA_DIR" in logs


def worker_processes(agent: int) -> list[int]:
    return sorted(
        pid
        for pid in children_of(agent)
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1] == str(agent)
    )


def start_torchrun_job(folder: Path, epochs: int):
    """torchrun --standalone with 2 workers and up to 2 restarts, in a session of its own; output merged."""
    return start_torchrun(
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=2",
        str(SCRIPT),
        *TINY[:-1],
        f"--epochs={epochs}",
        f"--output_dir={folder}",
    )


def test_torchrun_restart_continues_from_the_checkpoint(tmp_path):
    """A worker killed after epoch 2: torchrun restarts both, the new group forms, and the run continues from its
    checkpoint: every epoch once, epoch 1 trained once, exit 0."""
    folder = tmp_path / "out"
    process = start_torchrun_job(folder, epochs=4)
    try:
        wait_for_rows(folder, 2, process)
        os.kill(worker_processes(process.pid)[1], signal.SIGKILL)
        log = process.communicate(timeout=HANG_TIMEOUT)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, log
    assert pd.read_csv(folder / "pytorch_res.csv")["epoch"].tolist() == [1, 2, 3, 4]
    assert log.count("epoch 1/4") == 1 and "resuming after epoch" in log, log
    assert not list(folder.glob("previous-*")), "the restart moved the run's own results aside"


def torchrun_stop_scenario(who: str) -> tuple:
    """A torchrun job stopped after its first epoch."""
    folder = Path(tempfile.mkdtemp(prefix="torchrun-stop-")) / "out"
    process = start_torchrun_job(folder, epochs=9)
    try:
        wait_for_rows(folder, 1, process)
        while "epoch 1/9" not in Path(process.stdout_path).read_text():  # printed just after the files are handed on
            assert process.poll() is None
            time.sleep(0.02)
        workers = worker_processes(process.pid)
        if who == "ctrl_c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            os.kill(*((process.pid, signal.SIGTERM) if who == "torchrun" else (workers[1], signal.SIGUSR1)))
        started = time.monotonic()
        log = process.communicate(timeout=HANG_TIMEOUT)[0]
        seconds = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    time.sleep(0.5)
    left = [pid for pid in workers if alive(pid)]
    return process.returncode, log, seconds, folder, left


@pytest.mark.parametrize("who", ["torchrun", "worker", "ctrl_c"])
def test_a_stop_signal_under_torchrun_stops_the_job_instead_of_restarting_it(who):
    """SIGTERM to torchrun (scancel, Kubernetes), SIGUSR1 to one worker (SLURM's warning) or Ctrl-C: every worker
    stops within seconds, rank 0 says so in one line after its files, and torchrun does not restart them."""
    code, log, seconds, folder, left = scenario(torchrun_stop_scenario, who)
    assert seconds < 25, log
    assert code != 0  # torchrun reports the signal it got as a failure of its own
    assert log.count("epoch 1/9") == 1 and "resuming" not in log, "torchrun restarted the workers"
    stopped = "interrupted" if who == "ctrl_c" else "stopped by SIGTERM"
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    kept = f"the files in {folder} are from epoch {checkpoint['epoch']}; a torchrun restart or requeue continues"
    assert log.count(f"{stopped}: {kept} from them by itself, a new torchrun command with --resume True\n") == 1, log
    assert checkpoint["epoch"] == csv_rows(folder) >= 1 and not list(folder.glob("*.tmp*"))
    assert not left, "workers left behind"


def test_two_torchrun_nodes_restart_and_continue_wherever_rank_0_lands(tmp_path):
    """The same with two launchers ("machines", each its own OUTPUT_DIR): after the restart, global rank 0 may sit
    on the other machine, whose disk has no checkpoint; it receives the newest one."""
    from tests.conftest import free_port

    args = [*TINY[:-1], "--epochs=4"]
    nodes = two_nodes(
        tmp_path, free_port(), [[*args, f"--output_dir={tmp_path / f'out{n}'}"] for n in (0, 1)], restarts=2
    )
    try:
        deadline = time.monotonic() + HANG_TIMEOUT
        while max(csv_rows(tmp_path / "out0"), csv_rows(tmp_path / "out1")) < 2:
            assert time.monotonic() < deadline and all(node.poll() is None for node in nodes)
            time.sleep(0.1)
        os.kill(worker_processes(nodes[1].pid)[0], signal.SIGKILL)
        logs = [node.communicate(timeout=HANG_TIMEOUT)[0] for node in nodes]
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], logs
    finished = [n for n in (0, 1) if csv_rows(tmp_path / f"out{n}") == 4]
    assert len(finished) == 1, [csv_rows(tmp_path / f"out{n}") for n in (0, 1)]
    assert pd.read_csv(tmp_path / f"out{finished[0]}" / "pytorch_res.csv")["epoch"].tolist() == [1, 2, 3, 4]
    assert "".join(logs).count("epoch 1/4") == 1


def test_a_resume_finds_the_checkpoint_on_the_other_machine(tmp_path):
    """Local disks: the first run's global rank 0 wrote on machine A; on the resume the machines' order is swapped,
    and rank 0 (now on B, whose OUTPUT_DIR is empty) continues from A's checkpoint."""
    from tests.conftest import free_port

    args = [*TINY[:-1], "--epochs=4"]
    dirs = [f"--output_dir={tmp_path / 'a'}", f"--output_dir={tmp_path / 'b'}"]
    first = two_nodes(tmp_path, free_port(), [[*args, dirs[0]], [*args, dirs[1]]], rdzv="static")
    try:
        wait_for_rows(tmp_path / "a", 2, first[0])
    finally:
        for node in first:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    done = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["epoch"]
    written = pd.read_csv(tmp_path / "a" / "pytorch_res.csv").iloc[:done]
    resumed = two_nodes(
        tmp_path, free_port(), [[*args, dirs[1], "--resume=True"], [*args, dirs[0], "--resume=True"]], rdzv="static"
    )
    logs = [node.communicate(timeout=HANG_TIMEOUT)[0] for node in resumed]
    assert [node.returncode for node in resumed] == [0, 0], logs
    result = pd.read_csv(tmp_path / "b" / "pytorch_res.csv")
    assert result["epoch"].tolist() == [1, 2, 3, 4]
    pd.testing.assert_frame_equal(result.iloc[:done], written)  # the first run's rows, carried over
    assert f"resuming after epoch {done} of 4 (the checkpoint of rank 1's machine)" in "".join(logs)
