"""Image folders, decoded once into memory where they fit, else streamed (torch's DataLoader with a DistributedSampler,
DataLoader workers decoding the files as training goes; TEST_STREAM=1 makes the tiny folders stream), in real rank
processes: the order the ranks draw, folders of any image size, files that cannot be read or stop decoding mid-run."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

import data
import distribute_tools
import train_distribute
from safeguards import failures, settings
from tests.conftest import (
    BACKGROUND,
    HANG_TIMEOUT,
    PINNED,
    alive,
    call,
    children_of,
    clean_env,
    csv_rows,
    launch,
    needs,
    recorded_ranks,
    scenario,
    tiny_stream_args,
    wait_for_rows,
)
from tests.test_launch import ranks_left_after_a_while


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def data_dir(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--data_dir=")).partition("=")[2])


# ----------------------------------------------------------------------------- the order the ranks draw


def numbered_folder(root: Path, train: int, test: int, size: int = 8) -> None:
    """Images whose first two channels spell their number (number % 256, number // 256), in the order the folder is
    listed: class a's files, then class b's, each sorted by name."""
    for split, count in (("train", train), ("test", test)):
        for number in range(count):
            folder = root / split / ("a" if number < count // 2 else "b")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.full((size, size, 3), 60, np.uint8)
            pixels[..., 0], pixels[..., 1] = number % 256, number // 256
            Image.fromarray(pixels).save(folder / f"{number:05d}.png")


def read_in_ranks(answers: str, *argv: str) -> int:
    """Called in a process forked from the test server (conftest.call): 2 ranks, started by torch's elastic agent as a
    run's are, load the data as a run does, in memory and then streamed, and record for each loader the images each
    rank draws in epochs 1 and 2 and evaluates."""
    distribute_tools.run_distribute(_read_rank, 2, list(argv), answers)
    return 0


def _read_rank(argv: list[str], answers: str) -> None:
    cfg = settings.read(train_distribute, argv)
    info = distribute_tools.setup(60)
    for loader, share in (("memory", data.MEMORY_SHARE), ("stream", 0.0)):  # one rank's fork server serves both
        data.MEMORY_SHARE = share  # (as TEST_STREAM sets it)
        train, evaluated, record = data.load(cfg, info, torch.contiguous_format)
        drawn = {
            str(epoch): numbers(train.train_batches(cfg.BATCH_SIZE, 2, info.rank, cfg.SEED, epoch), record)
            for epoch in (1, 2)
        }
        drawn.update(test=numbers(evaluated["test"].eval_batches(2, info.rank), record), loader=record["loader"])
        Path(answers, f"{loader}-rank{info.rank}.json").write_text(json.dumps(drawn))
    distribute_tools.cleanup()


def numbers(batches: Iterable, record: dict) -> list[int]:
    """The numbered_folder images' numbers, in the order of the batches."""
    mean, std = torch.tensor(record["mean"]).view(1, 3, 1, 1), torch.tensor(record["std"]).view(1, 3, 1, 1)
    pixels = [((x * std + mean) * 255).round().long()[:, :, 0, 0] for x, _ in batches]  # back from the normalisation
    return [n for p in pixels for n in (p[:, 0] + 256 * p[:, 1]).tolist()]


def sampler_order(images: int, rank: int, seed: int, epoch: int) -> list[int]:
    """The share of `rank` of 2 in torch's DistributedSampler's shuffle of the epoch."""
    sampler = DistributedSampler(range(images), 2, rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def drawn_by_the_ranks() -> tuple[subprocess.CompletedProcess, Path]:
    """read_in_ranks on a numbered folder with a worker per rank, in the background (a scenario)."""
    folder = Path(tempfile.mkdtemp(prefix="drawn-"))
    numbered_folder(folder / "images", train=96, test=11)
    argv = [*PINNED, "--dataset=imagefolder", f"--data_dir={folder / 'images'}", "--num_workers=1",
            "--image_size=8", "--batch_size=16", "--augment=False", "--seed=3"]  # fmt: skip
    return call(f"{__name__}:read_in_ranks", str(folder), *argv, nice=BACKGROUND), folder


@needs((drawn_by_the_ranks,))
@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_every_image_is_used_once_an_epoch_in_an_order_that_changes_and_that_the_ranks_share(loader):
    """And an evaluation reads every test image exactly once: 11 of them, 6 on rank 0 and 5 on rank 1. In memory and
    streamed alike: DistributedSampler's order, so that a resume where the other loader is chosen goes on exactly."""
    result, folder = scenario(drawn_by_the_ranks)
    assert result.returncode == 0, result.stderr
    drawn = [json.loads((folder / f"{loader}-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert drawn[0]["loader"] == ("stream, 1 worker(s) per rank" if loader == "stream" else "memory")
    for epoch in ("1", "2"):
        shards = [theirs[epoch] for theirs in drawn]
        assert sorted(shards[0] + shards[1]) == list(range(96))  # every image once: 6 steps of 8 images per rank
        for rank, shard in enumerate(shards):  # one shuffle of SEED and the epoch, each rank its part of it
            assert shard == sampler_order(96, rank, seed=3, epoch=int(epoch))
    assert drawn[0]["1"] != drawn[0]["2"] and drawn[1]["1"] != drawn[1]["2"]
    assert drawn[0]["test"] + drawn[1]["test"] == list(range(11))


# ----------------------------------------------------------------------------- any image size


def trained_in_memory() -> SimpleNamespace:
    """tiny_stream's images trained for 2 epochs, decoded into memory by the ranks, in the background (a scenario)."""
    folder = Path(tempfile.mkdtemp(prefix="sized-"))
    run = launch(*tiny_stream_args(), "--epochs=2", f"--output_dir={folder}", nice=BACKGROUND)
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    return SimpleNamespace(folder=folder, code=run.returncode, out=out, err=err)


def test_a_link_to_nothing_or_classes_that_differ_are_one_line_before_any_rank_starts(tiny_stream, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(data_dir(tiny_stream), images)

    def refusal() -> list[str]:
        run = launch(*tiny_stream, f"--data_dir={images}", f"--output_dir={tmp_path / 'out'}")
        out, err = run.communicate(timeout=HANG_TIMEOUT)
        assert run.returncode == 2 and out == "", err
        return lines(err)

    (images / "train" / "a" / "gone.png").symlink_to(tmp_path / "elsewhere.png")
    assert refusal() == [
        f"error: {images}/train/a/gone.png is a link to nothing; remove it or put back what it points to"
    ]
    (images / "train" / "a" / "gone.png").unlink()
    (images / "test" / "b").rename(images / "test" / "c")
    assert refusal() == [
        f"error: {images}/train and test/ hold other classes (only in train/: b; only in test/: c); give both the "
        "same folders"
    ]


# ----------------------------------------------------------------------------- the worker processes


def holders_of(path: Path) -> set[int]:
    """The processes that have `path` open (Linux /proc): who holds an OS lock on it."""
    found = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                found.add(int(fd.parent.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers_and_rank_0_killed() -> SimpleNamespace:
    """A streamed run with a worker per reader, in the background (a scenario): once epoch 1's row is written, each
    rank's processes (command and parent) and who holds OUTPUT_DIR's lock; then SIGKILL to rank 0, the run's exit code
    and its processes still alive 10 s later (ranks_left_after_a_while)."""
    folder = Path(tempfile.mkdtemp(prefix="workers-")) / "out"
    (pids := folder.parent / "pids").mkdir()
    run = launch(
        *tiny_stream_args(),
        "--num_workers=1",
        "--epochs=30",
        "--eval_every=1",  # an evaluation in epoch 1: both readers' workers exist once its row is written
        f"--output_dir={folder}",
        env=clean_env(TEST_PIDS=str(pids), TEST_STREAM="1"),
        nice=BACKGROUND,
    )
    wait_for_rows(folder, 1, run)
    ranks = recorded_ranks(pids)
    below = {rank: [(pid, parent_of(pid), command_of(pid), command_of(parent_of(pid))) for pid in children_of(rank)]
             for rank in ranks}  # fmt: skip
    holders = holders_of(folder / ".lock")
    os.kill(ranks[0], signal.SIGKILL)
    code = run.wait(HANG_TIMEOUT)
    left = ranks_left_after_a_while([p[0] for processes in below.values() for p in processes])
    return SimpleNamespace(ranks=ranks, below=below, holders=holders, code=code, left=left)


@needs((workers_and_rank_0_killed,))
def test_workers_come_from_a_fork_server_hold_no_lock_and_end_with_their_rank():
    """Each rank's decoding workers (one for training, one for evaluation) are forked by a fork server, a new
    interpreter, never by the rank; only rank 0 holds OUTPUT_DIR's lock; and SIGKILL to rank 0 leaves no process of
    the run behind."""
    run = scenario(workers_and_rank_0_killed)
    for rank, processes in run.below.items():  # (pid, parent, command, the parent's command)
        workers = [p for p in processes if "multiprocessing.forkserver" not in p[3]]
        forked_here = [p for p in processes if p[1] == rank and "-c" not in p[2].split()]
        assert forked_here == [] and len(processes) - len(workers) >= 2, processes
    assert run.holders == {run.ranks[0]} and run.code == 1
    assert run.left == [], run.left


def test_a_folder_of_a_few_megabytes_is_decoded_by_its_ranks_alone_by_default(tiny_stream, tmp_path):
    """NUM_WORKERS=-1 on tiny_stream's 300 kB: no fork server, no worker; the ranks decode it before those start."""
    run = launch(*tiny_stream, "--num_workers=-1", "--epochs=30", f"--output_dir={tmp_path}")
    wait_for_rows(tmp_path, 1, run)
    processes = [command_of(pid) for pid in children_of(run.pid)]
    run.kill_session()
    assert len(processes) == 2 and not any("multiprocessing" in command for command in processes), processes


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def fork_servers(run, count: int = 2) -> list[int]:
    """The ranks' fork servers, as soon as `count` of them have started: they import torch for a while then."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while True:
        assert run.poll() is None and time.monotonic() < deadline, "no fork servers in time"
        found = [pid for pid in children_of(run.pid) if "multiprocessing.forkserver" in command_of(pid)]
        if len(found) >= count:
            return found
        time.sleep(0.01)


def stopped_with_workers(stop: str) -> SimpleNamespace:
    """A streamed run with a worker per reader, stopped (test_a_stop_with_decoding_workers_...), in the background (a
    scenario): its exit code, what its processes wrote once all have ended (or those left after HANG_TIMEOUT)."""
    folder = Path(tempfile.mkdtemp(prefix="stopped-workers-")) / "out"
    size = ["--image_size=30"] if stop == "sigterm mid-run" else []  # (also test_own_image_folders_of_any_size_train)
    run = launch(
        *tiny_stream_args(), *size, "--num_workers=1", "--epochs=30", f"--output_dir={folder}",
        env=clean_env(TEST_STREAM="1"), nice=BACKGROUND,
    )  # fmt: skip
    held = []
    if stop == "sigterm mid-run":
        wait_for_rows(folder, 2, run)  # evaluations have run: both readers' workers exist
    else:
        held = fork_servers(run)
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
    processes = children_of(run.pid)  # ranks, fork servers, workers, resource trackers
    os.kill(run.pid, signal.SIGTERM) if held == [] else os.killpg(run.pid, signal.SIGINT)
    code = run.wait(HANG_TIMEOUT)
    for pid in held:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + HANG_TIMEOUT  # (held fork servers first finish importing torch)
    while (left := [command_of(pid)[:80] for pid in processes if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out, err = run.communicate()  # all that they wrote
    return SimpleNamespace(folder=folder, code=code, out=out, err=err, left=left)


@needs((stopped_with_workers, "sigterm mid-run"), (stopped_with_workers, "ctrl-c while the fork servers import torch"))
@pytest.mark.parametrize("stop", ["sigterm mid-run", "ctrl-c while the fork servers import torch"])
def test_a_stop_with_decoding_workers_is_its_one_line_once_every_process_of_the_run_has_ended(stop):
    """SIGTERM to the launcher once both readers' workers decode; or Ctrl-C to every process of the run (its process
    group, as a terminal's where the ranks are forked) while the fork servers import torch, held there by SIGSTOP
    until the run has ended (the worker asked for then starts after its rank). stderr holds the stop's line alone,
    also once the fork servers, workers and resource trackers have ended: no tracker's "leaked semaphore objects"
    (the ranks end with os._exit), no fork server's KeyboardInterrupt (starting the tracker let SIGINT in again), no
    worker's traceback of a batch's hand-over that its stopping rank dropped (seen on torch 2.4.1)."""
    run = scenario(stopped_with_workers, stop)
    assert run.left == [], run.left
    if stop != "sigterm mid-run":
        assert run.code == 130 and lines(run.err) == [f"interrupted: {failures.NOTHING_KEPT}"], run.err
    else:
        kept = torch.load(run.folder / "checkpoint.pt", weights_only=True)["epoch"]
        line = f"stopped by SIGTERM: the files in {run.folder} are from epoch {kept}: continue with --resume True"
        assert run.code == 75 and lines(run.err) == [line], run.err


@needs((trained_in_memory,), (stopped_with_workers, "sigterm mid-run"))
@pytest.mark.parametrize("size", [16, 30])
def test_own_image_folders_of_any_size_train(size):
    """tiny_stream's images (16x16 files) trained at 16x16 for 2 epochs (decoded into memory by the ranks), and
    stretched to 30x30 (streamed by a worker process per rank: the run that SIGTERM stops once 2 epochs are in its
    CSV, whose exit and line test_a_stop_with_decoding_workers_... checks), the first line saying so."""
    if size == 16:
        run, loader, stretched = scenario(trained_in_memory), "memory", ""
        assert run.code == 0 and run.err == "" and csv_rows(run.folder) == 2, run.err
    else:
        run, loader = scenario(stopped_with_workers, "sigterm mid-run"), "stream, 1 worker(s) per rank"
        stretched = " (16x16 stretched to 30x30)"
        assert csv_rows(run.folder) >= 2
    assert f"300 train, 60 test images on imagefolder{stretched} | loader {loader} |" in run.out
    checkpoint = torch.load(run.folder / "checkpoint.pt", weights_only=True)
    assert checkpoint["data"]["image_size"] == size and f"of {size}x{size}" in checkpoint["data"]["identity"]
    assert checkpoint["data"]["classes"] == ["a", "b"]


# ----------------------------------------------------------------------------- a file that stops decoding


def test_in_memory_an_unreadable_file_is_left_out_once_and_a_file_spoiled_later_no_longer_matters(
    tiny_stream, tmp_path
):
    """The folder fits in memory: a training image unreadable from the start is left out of the run, named once; a
    training and a test image cut short once the run has trained an epoch are never read again (the accuracy is over
    all 60 test images); the run finishes."""
    images, folder = tmp_path / "images", tmp_path / "out"
    shutil.copytree(data_dir(tiny_stream), images)
    broken = images / "train" / "a" / "0002.png"
    broken.write_bytes(broken.read_bytes()[:100])
    run = launch(*tiny_stream, f"--data_dir={images}", "--epochs=3", f"--output_dir={folder}")
    wait_for_rows(folder, 1, run)
    for path in (images / "train" / "b" / "0001.png", images / "test" / "b" / "0001.png"):
        path.write_bytes(path.read_bytes()[:100])
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 0 and csv_rows(folder) == 3, err
    assert "299 train, 60 test images on imagefolder | loader memory |" in out
    assert lines(err) == [f"warning: 1 of 300 images cannot be read: {broken}; left out of the run"], err
    acc = pd.read_csv(folder / "pytorch_res.csv")["acc"]
    assert all(abs(a * 60 - round(a * 60)) < 1e-6 for a in acc.dropna()), acc  # shares of 60 images (EVAL_EVERY)


def test_in_memory_a_folder_with_too_many_unreadable_files_stops_every_rank_before_training_in_one_line(
    tiny_stream, tmp_path
):
    images, folder = tmp_path / "images", tmp_path / "out"
    shutil.copytree(data_dir(tiny_stream), images)
    damaged = sorted((images / "test" / "a").glob("*.png"))[:7]
    for path in damaged:
        path.write_bytes(b"")
    result = launch(*tiny_stream, f"--data_dir={images}", f"--output_dir={folder}")
    out, err = result.communicate(timeout=HANG_TIMEOUT)
    assert result.returncode == 2 and out == "" and csv_rows(folder) == 0, err
    assert lines(err) == [
        f"error: 7 of 60 images cannot be read: {', '.join(map(str, damaged[:3]))} and 4 more; put back good copies "
        "and resume; it stopped before any epoch finished; nothing to resume: start the run again"
    ]


def test_a_class_whose_every_training_image_is_unreadable_is_refused_as_an_empty_class_is(tiny_stream, tmp_path):
    """Under a tenth of the folder, but all of one class's training images: the run would train without that class."""
    images, folder = tmp_path / "images", tmp_path / "out"
    shutil.copytree(data_dir(tiny_stream), images)
    (images / "train" / "c").mkdir()
    (images / "test" / "c").mkdir()
    shutil.copy(images / "test" / "a" / "0000.png", images / "test" / "c" / "0000.png")
    for n in range(3):
        (images / "train" / "c" / f"{n}.png").write_bytes(b"not an image")
    result = launch(*tiny_stream, f"--data_dir={images}", f"--output_dir={folder}")
    out, err = result.communicate(timeout=HANG_TIMEOUT)
    assert result.returncode == 2 and out == "" and csv_rows(folder) == 0, err
    named = ", ".join(str(images / "train" / "c" / f"{n}.png") for n in range(3))
    assert lines(err) == [
        f"error: no image in {images / 'train' / 'c'} can be read (3 of 303 images cannot be read: {named}); put back "
        "good copies and resume; it stopped before any epoch finished; nothing to resume: start the run again"
    ]


def test_a_file_that_turns_unreadable_mid_run_is_left_out_and_named_and_the_run_goes_on(tiny_stream, tmp_path):
    """Streamed: a training image and a test image cut short (their headers whole) once the run has trained an epoch:
    every pass that meets one leaves it out and says so in a line naming it, the test accuracy over the images it
    could read; the run finishes."""
    images, folder = tmp_path / "images", tmp_path / "out"
    shutil.copytree(data_dir(tiny_stream), images)
    env = clean_env(TEST_STREAM="1")
    run = launch(*tiny_stream, f"--data_dir={images}", "--epochs=4", f"--output_dir={folder}", env=env)
    wait_for_rows(folder, 1, run)
    damaged = [images / "train" / "b" / "0001.png", images / "test" / "b" / "0001.png"]
    for path in damaged:
        path.write_bytes(path.read_bytes()[:100])
    out, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 0 and csv_rows(folder) == 4, err
    said = {
        f"warning: 1 of 300 images cannot be read: {damaged[0]}; left out of this pass",
        f"warning: 1 of 60 images cannot be read: {damaged[1]}; the accuracy is over the other 59",
    }
    assert set(lines(err)) == said, err  # each at least once: a pass may have read the file before it was cut
    acc = pd.read_csv(folder / "pytorch_res.csv")["acc"].iloc[-1]
    # a share of 59 images, not of 60 (k/59 is a share of 60 too only at 0 and 1: a network may get every image right)
    assert abs(acc * 59 - round(acc * 59)) < 1e-6, acc


def test_a_pass_with_too_many_unreadable_files_while_the_last_epochs_files_are_written_names_those_files(
    tiny_stream, tmp_path
):
    """Streamed: epoch 1's files take 2 s to write (TEST_SLOW_EPOCH); meanwhile epoch 2's evaluation meets 7 of the 60
    test images cut short, more than a tenth: the data is gone rather than one file. Every rank stops, and the line
    names the epoch whose files the run leaves: epoch 1's, finished first."""
    images, folder, marker = tmp_path / "images", tmp_path / "out", tmp_path / "writing"
    shutil.copytree(data_dir(tiny_stream), images)
    env = clean_env(TEST_SLOW_EPOCH="1", TEST_MARKER=str(marker), TEST_STREAM="1")
    every = "--eval_every=1"  # epoch 2 evaluates
    run = launch(*tiny_stream, f"--data_dir={images}", "--epochs=8", every, f"--output_dir={folder}", env=env)
    deadline = time.monotonic() + HANG_TIMEOUT
    while not marker.exists():  # epoch 2 trains; its evaluation reads the test images next
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.01)
    damaged = sorted((images / "test" / "b").glob("*.png"))[:7]
    for path in damaged:
        path.write_bytes(path.read_bytes()[:100])
    _, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 2, err
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == 1 == csv_rows(folder)
    named = ", ".join(map(str, damaged[:3]))
    assert lines(err) == [
        f"error: 7 of 60 images cannot be read: {named} and 4 more; put back good copies and resume; the files in "
        f"{folder} are from epoch 1: continue with --resume True"
    ]
