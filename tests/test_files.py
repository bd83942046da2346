"""Rank 0's files (safeguards/files.py) and the file side of starting a run (safeguards/start.py): atomic writes, the
background writer and its failures, earlier results moved aside, one run per folder, and the start rule. In-process
where no rank is needed; a second process where the point is another process."""

import errno
import os
import resource
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from safeguards import failures, files, start
from safeguards.failures import UserError
from tests.conftest import read_config

RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def row(epoch: int) -> dict:
    return {"epoch": epoch, "loss": 2.0 / epoch, "acc": 0.1 * epoch, "test_loss": 1.5 / epoch, "train_acc": 0.1,
            "lr": 0.1, "epoch_seconds": 1.0}  # fmt: skip


def checkpoint(epoch: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(epoch))},
        "epoch": epoch,
        "history": [row(e) for e in range(1, epoch + 1)],
    }


def run_epochs(writer: files.ResultWriter, epochs: range) -> list[dict]:
    """What train() does with the writer each epoch: wait for the previous epoch's files, then hand over its own."""
    history = []
    for epoch in epochs:
        writer.wait()
        history.append(row(epoch))
        writer.submit(checkpoint(epoch), history)
    return history


@pytest.fixture
def pictures(monkeypatch) -> list[int]:
    """The rows of each picture the writer draws, instead of drawing it (matplotlib takes a second to a picture)."""
    drawn: list[int] = []
    monkeypatch.setattr(files, "plot", lambda history, folder: drawn.append(len(history)))
    return drawn


def slow_csv(monkeypatch, seconds: float) -> None:
    """Every CSV write takes `seconds` longer."""
    write_csv = files.write_csv
    monkeypatch.setattr(files, "write_csv", lambda history, folder: (time.sleep(seconds), write_csv(history, folder)))


def failing_csv(monkeypatch, error: Exception, epoch: int) -> None:
    """The CSV write of `epoch` raises `error`; the others are written."""
    write_csv = files.write_csv

    def write(history: list, folder: str) -> None:
        if len(history) == epoch:
            raise error
        write_csv(history, folder)

    monkeypatch.setattr(files, "write_csv", write)


def failed_write(folder: Path, monkeypatch, error: Exception) -> str:
    """The writer's line when the first epoch's files fail to write with `error`."""
    failing_csv(monkeypatch, error, epoch=1)
    writer = files.ResultWriter(str(folder))
    writer.submit(checkpoint(1), [row(1)])
    with pytest.raises(UserError) as raised:
        writer.wait()
    writer.close()
    assert "\n" not in str(raised.value)
    return str(raised.value)


def full_disk(path: Path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ----------------------------------------------------------------------------- writing


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "pytorch_res.csv"
    files.write_atomically(str(target), lambda tmp: Path(tmp).write_text("epoch\n1\n"))

    def crash_halfway(tmp: str) -> None:
        Path(tmp).write_text("epo")
        raise full_disk(tmp)

    with pytest.raises(OSError):
        files.write_atomically(str(target), crash_halfway)
    assert target.read_text() == "epoch\n1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_res.csv"]  # no temporary left behind


def test_the_writer_writes_checkpoint_csv_and_picture(tmp_path):
    writer = files.ResultWriter(str(tmp_path))
    history = run_epochs(writer, range(1, 4))
    writer.close()
    saved = files.load_checkpoint(str(tmp_path))
    assert saved["epoch"] == 3 and torch.equal(saved["model"]["w"], torch.full((3,), 3.0))
    assert files.checkpoint_epoch(str(tmp_path)) == 3
    assert pd.read_csv(tmp_path / files.CSV_NAME).to_dict("records") == history
    assert (tmp_path / files.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files.RESULT_FILES)


def test_close_waits_for_the_pending_files(tmp_path, monkeypatch, pictures):
    slow_csv(monkeypatch, 0.3)
    writer = files.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1)])
    writer.close()
    assert len(pd.read_csv(tmp_path / files.CSV_NAME)) == 1 and pictures == [1]


def test_the_checkpoint_lands_before_the_csv_row(tmp_path, monkeypatch, pictures):
    """A kill -9 between the two leaves a checkpoint ahead of the CSV (rebuilt from it on resume), never behind."""
    seen, write_csv = [], files.write_csv

    def write(history: list, folder: str) -> None:
        seen.append((len(history), files.checkpoint_epoch(folder)))
        write_csv(history, folder)

    monkeypatch.setattr(files, "write_csv", write)
    writer = files.ResultWriter(str(tmp_path))
    run_epochs(writer, range(1, 4))
    writer.close()
    assert seen == [(1, 1), (2, 2), (3, 3)]


def test_wait_returns_once_the_previous_epochs_files_are_on_disk_and_says_how_long_it_took(
    tmp_path, monkeypatch, pictures
):
    slow_csv(monkeypatch, 0.5)
    writer = files.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1)])
    assert not (tmp_path / files.CSV_NAME).exists()  # still being written: training goes on meanwhile
    assert writer.wait() >= 0.4
    assert len(pd.read_csv(tmp_path / files.CSV_NAME)) == 1 and files.checkpoint_epoch(str(tmp_path)) == 1
    assert writer.wait() < 0.1  # nothing pending
    writer.close()


def test_the_checkpoint_is_the_state_when_it_was_handed_over(tmp_path, monkeypatch, pictures):
    """Training changes the weights while the files are written: the file holds them as they were."""
    slow_csv(monkeypatch, 0.2)
    weights = torch.zeros(4)
    writer = files.ResultWriter(str(tmp_path))
    writer.submit({"model": {"w": weights}, "epoch": 1}, [row(1)])
    weights += 1
    writer.close()
    assert files.load_checkpoint(str(tmp_path))["model"]["w"].sum() == 0


# ----------------------------------------------------------------------------- a write that fails


def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch, pictures):
    message = failed_write(tmp_path, monkeypatch, full_disk(tmp_path / files.CSV_NAME))
    assert message == (
        f"could not write {tmp_path / files.CSV_NAME} (No space left on device); free space, then continue with "
        f"--resume True (the checkpoint of epoch 1 is kept), or copy {tmp_path / files.CHECKPOINT_NAME} into another "
        "--output_dir and resume there"
    )


def test_a_failed_write_before_any_checkpoint_says_to_start_again(tmp_path):
    message = files.write_failure(full_disk(tmp_path / files.CHECKPOINT_NAME), str(tmp_path))
    assert message.startswith(f"could not write {tmp_path / files.CHECKPOINT_NAME} (No space left on device)")
    assert message.endswith("then start the run again") and "--resume" not in message


def test_a_failed_write_names_the_checkpoint_that_is_kept(tmp_path, monkeypatch, pictures):
    torch.save(checkpoint(4), tmp_path / files.CHECKPOINT_NAME)
    monkeypatch.setattr(files.torch, "save", lambda *args: (_ for _ in ()).throw(full_disk(tmp_path / "x")))
    writer = files.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(5), [row(e) for e in range(1, 6)])
    with pytest.raises(UserError, match=r"then continue with --resume True \(the checkpoint of epoch 4 is kept\), or "):
        writer.wait()
    writer.close()
    assert files.checkpoint_epoch(str(tmp_path)) == 4 and not list(tmp_path.glob("*.tmp*"))


def test_a_write_error_without_its_cause_is_one_line_too(tmp_path, monkeypatch, pictures):
    """torch.save reports a failed write as a RuntimeError, not an OSError."""
    error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 7040 vs 6976\nmore")
    message = failed_write(tmp_path, monkeypatch, error)
    assert message.startswith(f"could not write the files in {tmp_path} (RuntimeError: [enforce fail at inline_")
    assert "free space, then continue with --resume True" in message and "\n" not in message


def test_a_file_too_large_for_the_file_system_blames_no_ulimit(tmp_path):
    """EFBIG: the file system's own maximum (FAT32's 4 GiB, say), named as the system names it."""
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY
    message = files.write_failure(OSError(errno.EFBIG, os.strerror(errno.EFBIG), "/out/x.pt"), str(tmp_path))
    assert message.startswith("could not write /out/x.pt (File too large)") and "ulimit" not in message, message


def test_after_a_failed_write_close_draws_only_the_rows_on_disk(tmp_path, monkeypatch, pictures):
    monkeypatch.setattr(files, "PLOT_SHARE", 1e-9)  # after the first picture, none until close()
    failing_csv(monkeypatch, full_disk(tmp_path / files.CSV_NAME), epoch=3)
    writer = files.ResultWriter(str(tmp_path))
    with pytest.raises(UserError):
        run_epochs(writer, range(1, 5))  # epoch 3's files fail; training learns it as epoch 4 waits
    writer.close()
    assert pictures == [1, 2]  # the first epoch's picture, then close() draws the two epochs the CSV holds
    assert len(pd.read_csv(tmp_path / files.CSV_NAME)) == 2


# ----------------------------------------------------------------------------- earlier results


def test_earlier_results_move_aside_and_nothing_else_moves(tmp_path):
    for name in files.RESULT_FILES:
        (tmp_path / name).write_text(name)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "previous-elsewhere").mkdir()
    moved = Path(start.move_aside(str(tmp_path)))
    assert moved.parent == tmp_path and moved.name.startswith("previous-")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["notes.txt"]
    assert {p.name: p.read_text() for p in moved.iterdir()} == {name: name for name in files.RESULT_FILES}


def test_moving_aside_never_overwrites_an_earlier_move(tmp_path):
    stamp = time.time() - 3600
    moved = []
    for run in ("first", "second", "third"):
        (tmp_path / files.CSV_NAME).write_text(run)
        os.utime(tmp_path / files.CSV_NAME, (stamp, stamp))  # the same second: the same folder name
        moved.append(start.move_aside(str(tmp_path)))
    assert len(set(moved)) == 3
    assert [Path(folder, files.CSV_NAME).read_text() for folder in moved] == ["first", "second", "third"]


def test_nothing_to_move_aside_moves_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert start.move_aside(str(tmp_path)) is None and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# ----------------------------------------------------------------------------- one run per folder


@contextmanager
def another_process_holding(folder: Path) -> Iterator[int]:
    """A forked process that holds the lock on `folder` until it is killed (its process id)."""
    marker = folder.parent / f"{folder.name}-held"
    pid = os.fork()
    if pid == 0:  # the child: no torch, no test, only the lock
        try:
            held = start.lock(str(folder), wait_s=0)
            marker.write_text("held")
            time.sleep(600)
            held.release()
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline, "the lock was not taken"
            time.sleep(0.01)
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_second_lock_is_refused_in_one_line_and_a_lock_dies_with_its_process(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    with another_process_holding(folder):
        with pytest.raises(UserError) as refusal:
            start.lock(str(folder), wait_s=0)
        in_use = f"OUTPUT_DIR {folder} is in use by another run; wait for it or choose another"
        assert str(refusal.value) == in_use
        with pytest.raises(UserError, match="is in use by another run"):
            start.lock(str(folder), wait_s=0.3)  # a restart's short wait for its previous attempt: still refused
    start.lock(str(folder), wait_s=0).release()  # the holder was killed with SIGKILL: the kernel released its lock


def test_an_output_dir_that_cannot_hold_the_lock_is_one_line(tmp_path):
    (tmp_path / ".lock").mkdir()  # as unwritable as a read-only file system, even for root
    with pytest.raises(UserError, match=f"^OUTPUT_DIR {tmp_path} is not writable \\(Is a directory\\); choose another"):
        start.lock(str(tmp_path), wait_s=0)


# ----------------------------------------------------------------------------- the start rule


@pytest.fixture
def first_start(monkeypatch) -> pytest.MonkeyPatch:
    """No restart count in the environment: a user's first start."""
    for name in RESTART_COUNTS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def saved_by(argv: list[str], epoch: int) -> dict:
    return {"config": vars(read_config(argv)), "epoch": epoch, "history": []}


RUN = ["--epochs=5", "--output_dir=/runs/a", "--lr=0.4"]


@pytest.mark.parametrize(
    "env, resume, saved, kind",
    [
        ({}, False, None, "new"),
        ({}, False, saved_by(RUN, 2), "new"),  # a checkpoint there is an earlier run's: moved aside, not continued
        ({"TORCHELASTIC_RESTART_COUNT": "0"}, False, saved_by(RUN, 2), "new"),  # torchrun's first attempt
        ({}, True, saved_by(RUN, 2), "resume"),
        ({}, True, saved_by(RUN, 5), "finished"),
        ({"TORCHELASTIC_RESTART_COUNT": "1"}, False, None, "new"),  # a restart before the first checkpoint
        ({"TORCHELASTIC_RESTART_COUNT": "1"}, False, saved_by(RUN, 2), "resume"),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, False, saved_by(RUN, 5), "finished"),
        ({"SLURM_RESTART_COUNT": "1"}, False, saved_by(RUN, 2), "resume"),  # a requeued job
    ],
)
def test_the_start_rule(first_start, env, resume, saved, kind):
    for name, value in env.items():
        first_start.setenv(name, value)
    assert start.decide(read_config([*RUN, f"--resume={resume}"]), saved, start.restarted_by())[0] == kind


def test_a_node_whose_ranks_know_no_written_epoch_still_says_the_way_on(monkeypatch):
    """Under torchrun without our launcher, a rank other than 0 that saw no epoch written (stopped in epoch 1 or 2)."""
    monkeypatch.delenv(failures.LAUNCHER_PID, raising=False)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "1")):
        monkeypatch.setenv(name, value)
    assert start.kept_files("/runs/a", known=0) == (
        "the files are in /runs/a on the node of global rank 0 (no epoch known here); continue with the same command "
        "on every node and --resume True (torchrun's restarts and a SLURM requeue do so by themselves)"
    )


def test_resume_without_a_checkpoint_is_refused_in_one_line(first_start, tmp_path):
    with pytest.raises(UserError) as refusal:
        start.decide(read_config([f"--output_dir={tmp_path}", "--resume"]), None)
    message = str(refusal.value)
    assert message == f"RESUME=True but there is no checkpoint in {tmp_path}; start a new run without it"


def test_resume_with_other_settings_is_refused(first_start):
    saved = saved_by(RUN, 2)  # read first: a reading of the settings notes which ones its command line gives
    with pytest.raises(UserError, match="^RESUME=True: LR=0.1 differs from the checkpoint's 0.4 in /runs/a; resume wi"):
        start.decide(read_config([*RUN, "--lr=0.1", "--resume"]), saved)


@pytest.mark.parametrize("count", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restart_with_other_settings_is_refused_in_restart_words(first_start, count):
    first_start.setenv(count, "3")
    with pytest.raises(UserError) as refusal:
        start.decide(read_config(["--epochs=8", "--output_dir=/runs/a"]), saved_by(RUN, 2), start.restarted_by())
    assert str(refusal.value).startswith(
        f"this start is a restart ({count}=3): EPOCHS=8 differs from the checkpoint's 5"
    )
    assert "--resume" not in str(refusal.value)


def test_epochs_without_evaluation_leave_the_summary_and_the_picture_whole(tmp_path):
    """Evaluating every few epochs: the others' acc and test_loss are nan. The last line's best and final accuracy
    are of the epochs evaluated; without any, it names none. The picture is drawn with gaps."""
    history = [
        row(epoch) | ({} if epoch % 2 == 0 else {"acc": float("nan"), "test_loss": float("nan")})
        for epoch in range(1, 6)
    ]
    assert (
        files.summary_line(history, "out")
        == "done: 5 epochs; best acc 0.4000 (epoch 4: best.pt), final acc 0.4000; results in out"
    )
    assert files.summary_line(history[:1], "out") == "done: 1 epochs; results in out"
    files.plot(history, str(tmp_path))
    assert (tmp_path / files.PLOT_NAME).stat().st_size > 0


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "constant"])
def test_a_run_of_a_few_steps_in_all_says_so_in_its_first_line(schedule):
    """A global batch that leaves 2 steps in the whole run: a schedule with a warm-up (onecycle, cosine) can neither
    warm up nor decay; a constant LR has neither to do."""
    cfg = read_config(
        ["--dataset=synthetic", "--epochs=2", "--batch_size=512", f"--schedule={schedule}", "--compile=False"]
    )
    info = SimpleNamespace(world_size=2, device=torch.device("cpu"), backend="gloo")
    record = {"identity": "1,000 train, 200 test images of 32x32", "stretched": None, "loader": "memory"}
    line = files.describe(torch.nn.Linear(1, 1), cfg, info, {**record, "train_images": 1000}, 1, "fp32")
    too_few = f"| fp32 | only 2 steps in all, too few for {schedule}: lower --batch_size or add epochs"
    assert (too_few in line) == (schedule != "constant"), line
    cfg.EPOCHS = 10
    assert "too few" not in files.describe(
        torch.nn.Linear(1, 1), cfg, info, {**record, "train_images": 1000}, 1, "fp32"
    )


@pytest.mark.parametrize("selection", ["acc", "val_acc"])
def test_best_pt_holds_the_best_epoch_by_the_held_out_split_where_there_is_one_the_later_on_a_tie(
    tmp_path, pictures, selection
):
    """best.pt is the checkpoint of the epoch with the best selection accuracy so far (HOLDOUT's val_acc where the
    rows have it, else the test's acc; an epoch without evaluation never), the later of equals; written before
    checkpoint.pt, so that no checkpoint names a best epoch that best.pt does not hold."""
    writer, history, found = files.ResultWriter(str(tmp_path)), [], []
    scores = [0.2, 0.5, 0.3, 0.5, float("nan")]
    for epoch, score in enumerate(scores, 1):
        other = 1 - score  # the other column: were it the selection, the best epoch would be another
        history.append(row(epoch) | ({"acc": score} if selection == "acc" else {"acc": other, "val_acc": score}))
        writer.submit(checkpoint(epoch), history)
        writer.wait()
        found.append(torch.load(tmp_path / files.BEST_NAME, weights_only=True)["epoch"])
        assert torch.load(tmp_path / files.CHECKPOINT_NAME, weights_only=True)["epoch"] == epoch
    writer.close()
    assert found == [1, 2, 2, 4, 4]
    assert files.summary_line(history, "out").startswith(f"done: 5 epochs; best {selection} 0.5000 (epoch 4: best.pt)")


def test_a_resume_from_the_checkpoint_on_another_machine_brings_its_best_pt_where_the_files_go_now(
    tmp_path, first_start
):
    """Machines with disks of their own: the resume goes on from the newest checkpoint, which another machine's rank
    hands over with that machine's best.pt; rank 0 writes it into its own OUTPUT_DIR, where the files go from now on."""
    saved = saved_by(["--epochs=5", f"--output_dir={tmp_path / 'there'}"], 2)
    handed = saved | {"best.pt": b"the other machine's best.pt"}
    cfg = read_config(["--epochs=5", f"--output_dir={tmp_path / 'here'}", "--resume=True"])
    kind, checkpoint, _ = start.begin(cfg, "", handed, where="node1:/there")
    assert kind == "resume" and "best.pt" not in checkpoint  # the bytes go to the file, not on to every rank
    assert (tmp_path / "here" / files.BEST_NAME).read_bytes() == b"the other machine's best.pt"


def test_progress_in_a_log_starts_its_clock_after_the_first_step(monkeypatch, capsys):
    """A compiled epoch's first step is the compile (minutes): the progress lines' rate and time left are those of
    the steps after it, and the first line comes after the second step."""
    monkeypatch.setattr(files, "PROGRESS_EVERY", 0.0)
    for step, _ in enumerate(files.progress(range(5), 5, 1, SimpleNamespace(BATCH_SIZE=10, EPOCHS=1))):
        time.sleep(0.5 if step == 0 else 0.01)  # the first step takes 50 times as long as the others
    said = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1].split(" of")[0] for line in said] == ["2", "3", "4", "5"], said
    assert int(said[0].split(" steps, ")[1].split(" img/s")[0].replace(",", "")) > 100, said  # 4 img/s counting it
