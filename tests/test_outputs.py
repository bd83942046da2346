"""Files in OUTPUT_DIR: the per-epoch row, atomic writes, the background writer and its failures, moving an earlier
run aside, leftovers of a killed run, one run per folder."""

import errno
import os
import signal
import threading
import time
from pathlib import Path

import outputs
import pandas as pd
import pytest
import resume
import torch
from processes import UserError

from tests.conftest import Launched, clean_env, launch, read_config


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "pytorch_res.csv"
    outputs.write_atomically(str(target), lambda tmp: open(tmp, "w").write("epoch\n1\n"))

    def crash_halfway(tmp):
        open(tmp, "w").write("epo")
        raise OSError("disk full")

    with pytest.raises(OSError):
        outputs.write_atomically(str(target), crash_halfway)
    assert target.read_text() == "epoch\n1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_res.csv"]


def test_earlier_results_move_aside_and_nothing_else_moves(tmp_path):
    for name in outputs.RESULT_FILES:
        (tmp_path / name).write_text(name)
    (tmp_path / "notes.txt").write_text("mine")
    moved_to = resume.move_aside(str(tmp_path))
    assert moved_to and sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["notes.txt"]
    for name in outputs.RESULT_FILES:
        assert (tmp_path / moved_to / name).read_text() == name
    (tmp_path / "pytorch_res.csv").write_text("second")
    second = resume.move_aside(str(tmp_path))
    assert second != moved_to and (tmp_path / second / "pytorch_res.csv").read_text() == "second"
    assert resume.move_aside(str(tmp_path / "never-used")) is None


def test_temporaries_of_a_killed_run_are_removed(tmp_path):
    (tmp_path / "checkpoint.pt.tmp4242").write_text("half")
    (tmp_path / "pytorch_res.csv").write_text("whole")
    resume.remove_temporaries(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_res.csv"]


def row(epoch: int, acc: float, speed: float) -> dict:
    values = {"epoch": epoch, "loss": 1.0 / epoch, "acc": acc, "train_acc": acc, "lr": 0.1, "epoch_seconds": 10.0}
    values.update(elapsed_seconds=12.0 + 10 * epoch, images_per_second=speed, write_wait_seconds=0.5)
    return {name: values.get(name, 1.0) for name in outputs.COLUMNS}


def test_the_row_has_one_definition_with_a_meaning_for_each_column(tmp_path):
    assert list(outputs.COLUMNS)[:3] == ["epoch", "loss", "acc"] and all(m for m, _ in outputs.COLUMNS.values())
    outputs.write_csv([row(1, 0.5, 100.0)], str(tmp_path))
    assert list(pd.read_csv(tmp_path / "pytorch_res.csv").columns) == list(outputs.COLUMNS)
    line = outputs.epoch_line(row(3, 0.25, 1234.0), 10)
    assert line.startswith("epoch  3/10  loss 0.3333  acc 0.2500") and "1,234 img/s" in line and "10.0 s" in line


def test_a_row_is_plain_numbers_and_only_columns():
    import numpy

    checked = outputs.checked_row({**row(1, 0.5, 100.0), "acc": numpy.float32(0.5), "loss": torch.tensor(2.0)})
    assert type(checked["acc"]) is float and type(checked["loss"]) is float and type(checked["epoch"]) is int
    with pytest.raises(UserError, match="the row's 'extra' is not in outputs.COLUMNS; add it there"):
        outputs.checked_row({**row(1, 0.5, 100.0), "extra": 1.0})
    with pytest.raises(UserError, match="the row's acc is str, not a number"):
        outputs.checked_row({**row(1, 0.5, 100.0), "acc": "high"})


def test_rows_saved_before_a_column_existed_get_an_empty_cell(tmp_path):
    old = {name: value for name, value in row(1, 0.5, 100.0).items() if name != "write_wait_seconds"}
    outputs.write_csv([old, row(2, 0.6, 100.0)], str(tmp_path))
    df = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert list(df.columns) == list(outputs.COLUMNS)
    assert df["write_wait_seconds"].isna().tolist() == [True, False] and df["acc"].tolist() == [0.5, 0.6]
    outputs.plot_history([old, row(2, 0.6, 100.0)], str(tmp_path))  # the picture copes with the gap too
    assert "2 epochs" in outputs.summary_line([old, row(2, 0.6, 100.0)], str(tmp_path))


def test_summary_names_best_final_and_the_whole_run(tmp_path):
    line = outputs.summary_line([row(1, 0.5, 100.0), row(2, 0.4, 300.0)], str(tmp_path))
    assert "best acc 0.5000 (epoch 1)" in line and "final acc 0.4000" in line and "200 img/s" in line
    assert "2 epochs in 0m32s" in line  # the last epoch's elapsed_seconds: start-up included
    assert "20.0 s training and evaluation, 1.0 s waiting for files" in line


# ----------------------------------------------------------------------------- the background writer


def checkpoint(epoch: int) -> dict:
    return {"model": {"w": torch.full((3,), float(epoch))}, "epoch": epoch}


def test_writer_writes_checkpoint_csv_and_picture_and_close_waits_for_them(tmp_path):
    writer = outputs.ResultWriter(str(tmp_path))
    history = []
    for epoch in (1, 2, 3):
        assert writer.wait() >= 0
        history.append(row(epoch, 0.1 * epoch, 100.0))
        writer.submit(checkpoint(epoch), history)
    writer.close()
    assert outputs.load_checkpoint(str(tmp_path))["epoch"] == 3
    assert (tmp_path / "pytorch_res.csv").read_text().count("\n") == 4  # header and 3 rows
    assert (tmp_path / "pytorch_res.png").stat().st_size > 10_000  # drawn at close with every epoch


def test_writer_checkpoint_lands_before_the_csv_row_that_follows_from_it(tmp_path, monkeypatch):
    order = []
    for name in ("save_checkpoint", "write_csv", "plot_history"):
        original = getattr(outputs, name)
        monkeypatch.setattr(outputs, name, lambda *a, _f=original, _n=name: (order.append(_n), _f(*a))[1])
    writer = outputs.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1, 0.1, 1.0)])
    writer.close()
    assert order == ["save_checkpoint", "write_csv", "plot_history"]


def test_writer_keeps_one_epoch_pending_and_reports_the_wait(tmp_path, monkeypatch):
    release = threading.Event()
    original = outputs.save_checkpoint
    monkeypatch.setattr(outputs, "save_checkpoint", lambda state, folder: (release.wait(5), original(state, folder)))
    writer = outputs.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1, 0.1, 1.0)])
    with pytest.raises(AssertionError):
        writer.submit(checkpoint(2), [row(1, 0.1, 1.0), row(2, 0.2, 1.0)])  # never two epochs in flight
    threading.Timer(0.3, release.set).start()
    assert writer.wait() >= 0.25  # training would have waited this long
    writer.close()


def failed_write(tmp_path, monkeypatch, error: Exception, where: str = "save_checkpoint") -> str:
    """The writer's one line when `where` raises `error` in epoch 1."""

    def fail(*args):
        raise error

    monkeypatch.setattr(outputs, where, fail)
    writer = outputs.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1, 0.1, 1.0)])
    with pytest.raises(UserError) as raised:
        writer.wait()
    writer.close()
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_a_failed_write_is_one_line_naming_the_file(tmp_path, monkeypatch):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoint.pt"))
    message = failed_write(tmp_path, monkeypatch, full)
    assert message.startswith(f"could not write {tmp_path}/checkpoint.pt (No space left on device); free space")
    # before the first checkpoint there is nothing to resume, and the line says so
    assert message.endswith("then start the run again") and "--resume" not in message


def test_a_failed_write_after_a_checkpoint_says_which_one_is_kept(tmp_path, monkeypatch):
    outputs.save_checkpoint(checkpoint(4), str(tmp_path))
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoint.pt"))
    message = failed_write(tmp_path, monkeypatch, full)
    assert message.endswith("then continue with --resume True (the checkpoint of epoch 4 is kept)")


def test_a_full_disk_under_torch_save_is_one_line_too(tmp_path, monkeypatch):
    """torch.save reports a failed write as a RuntimeError, not an OSError."""
    monkeypatch.setattr(
        outputs.torch,
        "save",
        lambda state, path: (_ for _ in ()).throw(
            RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 7040 vs 6976")
        ),
    )
    writer = outputs.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1, 0.1, 1.0)])
    with pytest.raises(UserError, match=f"could not write the files in {tmp_path} \\(RuntimeError: \\[enforce fail"):
        writer.wait()
    writer.close()
    assert not list(tmp_path.glob("*.tmp*"))


def test_any_failure_of_the_writer_is_one_line(tmp_path, monkeypatch):
    """Not only OSError and RuntimeError: a ValueError from the CSV writer (a bug) reaches every rank as one line."""
    message = failed_write(tmp_path, monkeypatch, ValueError("dict contains fields not in fieldnames"), "write_csv")
    assert message.startswith("could not write the files in") and "ValueError: dict contains fields" in message


def test_a_file_size_limit_is_named_as_such(tmp_path):
    """ulimit -f: torch.save fails with an error that does not say why; the line names the limit, not a full disk."""
    run = launch(str(tmp_path), call="tests.workers:write_one_checkpoint", file_size_limit=65536)
    out, _ = run.communicate(timeout=60)
    assert "(the file size limit, ulimit -f, is 64 KB); raise it (ulimit -f unlimited)" in out, out


def test_an_interrupted_wait_leaves_the_write_to_close(tmp_path, monkeypatch):
    """Ctrl-C (or a stop signal) while training waits for the writer: close() still finishes the files."""
    import _thread

    save = outputs.save_checkpoint
    monkeypatch.setattr(outputs, "save_checkpoint", lambda state, folder: (time.sleep(1.0), save(state, folder)))
    writer = outputs.ResultWriter(str(tmp_path))
    writer.submit(checkpoint(1), [row(1, 0.1, 1.0)])
    # Python's own Ctrl-C handler: a launcher that ran in this process may have left its own in place
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.2, _thread.interrupt_main).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
    finally:
        signal.signal(signal.SIGINT, saved)
    assert writer.pending is not None
    writer.close()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert (tmp_path / "pytorch_res.csv").exists() and (tmp_path / "pytorch_res.png").exists()


def test_a_writer_whose_close_a_stop_signal_cut_off_is_finished_before_the_last_line(tmp_path, monkeypatch):
    """A Ctrl-C held up in a collective that a peer left lands on the first line of close(), which then never
    runs; the stop line named the epoch before the one the files came to hold (torch 2.4.1, 10 of 10 runs with that
    timing forced). finish_writers(), called before that line, finishes the files."""
    save = outputs.save_checkpoint
    monkeypatch.setattr(outputs, "save_checkpoint", lambda state, folder: (time.sleep(0.5), save(state, folder)))
    writer, finished = outputs.ResultWriter(str(tmp_path)), outputs.ResultWriter(str(tmp_path / "other"))
    finished.close()
    writer.submit(checkpoint(2), [row(1, 0.1, 1.0), row(2, 0.1, 1.0)])
    outputs.finish_writers()  # writer.close() was never reached
    assert outputs.checkpoint_epoch(str(tmp_path)) == 2 and (tmp_path / "pytorch_res.png").exists()
    assert not (tmp_path / "other").exists()  # a writer closed before is not closed again


def test_the_picture_is_redrawn_within_its_time_share(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(outputs, "plot_history", lambda history, folder: (drawn.append(len(history)), time.sleep(0.05)))
    writer = outputs.ResultWriter(str(tmp_path))
    history = []
    for epoch in range(1, 6):
        writer.wait()
        history.append(row(epoch, 0.1, 1.0))
        writer.submit(checkpoint(epoch), history)
    writer.close()
    assert drawn[0] == 1 and drawn[-1] == 5  # the first epoch's, and every epoch's at the end
    assert len(drawn) < 5  # 0.05 s per drawing and at most 2% of the time: not after every epoch


def test_snapshot_is_a_copy(tmp_path):
    weights = torch.zeros(4)
    copy = outputs.cpu_snapshot({"w": weights, "rows": [{"a": 1}]})
    weights += 1
    assert copy["w"].sum() == 0 and copy["rows"] == [{"a": 1}]


# ----------------------------------------------------------------------------- one run per folder


def test_a_second_run_is_refused_while_the_first_holds_the_folder(tmp_path):
    first = resume.lock_output_dir(str(tmp_path / "out"))
    with pytest.raises(UserError, match=f"OUTPUT_DIR {tmp_path}/out is in use by another run \\(pid {os.getpid()}"):
        resume.lock_output_dir(str(tmp_path / "out"))
    with pytest.raises(UserError, match="is in use by another run"):
        resume.check_before_start(read_config([f"--output_dir={tmp_path / 'out'}"]))  # before any rank starts
    first.close()
    resume.lock_output_dir(str(tmp_path / "out")).close()  # free again


def hold_output_dir(folder: Path, seconds: float, **env: str) -> Launched:
    """Another process that claims `folder` and keeps it for `seconds`; returns once it holds it."""
    marker = folder.parent / f"{folder.name}-held-{time.monotonic_ns()}"
    holder = launch(str(folder), seconds, str(marker), call="tests.workers:hold_output_dir", env=clean_env(**env))
    while not marker.exists():
        assert holder.poll() is None, holder.communicate()
        time.sleep(0.01)
    return holder


def test_an_output_dir_that_cannot_hold_the_lock_is_one_line(tmp_path):
    """Under torchrun no launcher checks OUTPUT_DIR first: rank 0's claim says it in one line."""
    (tmp_path / ".lock").mkdir()  # as unwritable as a read-only file system, even for root
    with pytest.raises(UserError, match=f"OUTPUT_DIR {tmp_path} is not writable \\(Is a directory"):
        resume.lock_output_dir(str(tmp_path))


def test_a_lock_dies_with_its_process(tmp_path):
    """kill -9 of a run leaves no stale lock behind: the kernel releases it."""
    holder = hold_output_dir(tmp_path, 60)
    with pytest.raises(UserError):
        resume.lock_output_dir(str(tmp_path))
    holder.kill()
    holder.wait()
    resume.lock_output_dir(str(tmp_path)).close()


def test_a_restart_of_the_same_run_takes_the_folder_over(tmp_path, monkeypatch):
    """torchrun's next attempt (same run id) waits for the previous attempt's process to go."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    holder = hold_output_dir(tmp_path, 1.5)
    started = time.monotonic()
    resume.lock_output_dir(str(tmp_path)).close()  # waits instead of refusing
    assert time.monotonic() - started > 0.5
    holder.wait()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-8")
    holder = hold_output_dir(tmp_path, 30, TORCHELASTIC_RUN_ID="other")
    with pytest.raises(UserError, match="in use by another run"):
        resume.lock_output_dir(str(tmp_path))  # another run: refused at once
    holder.kill()
    holder.wait()
