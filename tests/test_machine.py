"""The machine around a run: full and read-only disks, a restarted job whose settings changed, stop signals before
the ranks start, a stop that Python drops. Each ends in one line naming the problem and the fix, with its exit code,
and loses nothing. The disks are real: a small tmpfs, or a read-only bind mount (root only; skipped otherwise), each
unmounted afterwards."""

import os
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import image_folder
import outputs
import pytest
import torch
from processes import UserError

from tests.conftest import HANG_TIMEOUT, TINY, call, clean_env, image_folder_of_noise, launch, run_script, width

FOLDER = [*width(4), "--dataset=imagefolder", "--image_size=16", "--batch_size=16", "--epochs=1", "--loader=memory"]


def _mount(*arguments: str) -> None:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a file system")
    done = subprocess.run(["mount", *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@contextmanager
def full_disk(folder: Path, megabytes: int = 2, room: int = 0) -> Iterator[Path]:
    """A tmpfs of `megabytes` at `folder`, filled up to `room` bytes (0: nothing more fits)."""
    folder.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder))
    try:
        fill(folder, room)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path, room: int = 0) -> None:
    """Fill the file system of `folder` until at most `room` bytes are free."""
    with open(folder / f"filler-{time.monotonic_ns()}", "wb") as f:
        try:
            f.write(bytes(max(shutil.disk_usage(folder).free - room, 0)))
            f.flush()
        except OSError:  # it is full
            pass


@contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """`folder` made read-only where it is (a read-only bind mount of itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(folder), str(folder))
    try:
        _mount("-o", "remount,ro,bind", str(folder))
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def one_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line a run ended with: its exit code, no traceback, nothing else on stderr."""
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr and "Exception ignored" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- full disks


def test_a_full_disk_at_the_start_is_one_line_and_leaves_no_lock(tmp_path):
    with full_disk(tmp_path / "disk") as disk:
        result = run_script(*TINY, "--epochs=1", f"--output_dir={disk / 'out'}")
        line = one_line(result)
        assert line.startswith(f"error: cannot write to OUTPUT_DIR {disk / 'out'} (No space left on device)")
        assert not (disk / "out" / ".lock").exists()


def test_a_data_dir_too_full_for_the_decoded_copy_names_the_disk(tmp_path):
    """Beside the data and in the user's cache (XDG_CACHE_HOME, here on the same full disk): no room, one line."""
    with full_disk(tmp_path / "disk", megabytes=4, room=2**21) as disk:
        image_folder_of_noise(disk / "images", train=32, test=8, size=16)
        fill(disk)
        env = clean_env(XDG_CACHE_HOME=str(disk / "cache"))
        result = run_script(*FOLDER, f"--data_dir={disk / 'images'}", f"--output_dir={tmp_path / 'out'}", env=env)
        line = one_line(result)
        assert f"no folder can take the decoded copy of {disk / 'images' / 'train'}" in line
        assert f"{disk / 'images' / '.decoded'}: 0 MB free" in line and "--loader stream" in line
        assert not (tmp_path / "out").exists()


def test_a_decoded_copy_that_fills_the_disk_as_it_is_written_is_one_line(tmp_path):
    """torch.save says "iostream error" for a full disk: the line says what happened, and no partial file stays."""
    with full_disk(tmp_path / "disk") as disk:
        with pytest.raises(UserError, match=r"No space left on device\); free space there") as caught:
            image_folder._write_cache(str(disk / "train-0.pt"), {"images": torch.zeros(2**20)}, "DIR/train")
        assert "could not write the decoded copy of DIR/train" in str(caught.value)
        assert sorted(p.name for p in disk.iterdir() if not p.name.startswith("filler")) == []


def test_after_a_failed_write_the_picture_shows_only_the_epochs_on_disk(tmp_path, monkeypatch):
    """The disk fills up after epoch 1: epoch 2's write fails, and the picture drawn as the writer closes holds
    epoch 1 only, as the CSV and the checkpoint do."""
    drawn = []
    plot = outputs.plot_history
    monkeypatch.setattr(outputs, "plot_history", lambda rows, folder: drawn.append(len(rows)) or plot(rows, folder))
    rows = [{"epoch": e, "loss": 1.0 / e, "acc": 0.5, "test_loss": 1.0, "lr": 0.1} for e in (1, 2)]
    with full_disk(tmp_path / "disk", megabytes=8, room=2**22) as disk:
        writer = outputs.ResultWriter(str(disk))
        writer.submit({"epoch": 1, "weights": torch.zeros(10)}, rows[:1])
        writer.wait()
        fill(disk)
        writer.submit({"epoch": 2, "weights": torch.zeros(2**20)}, rows)
        with pytest.raises(UserError, match="No space left on device"):
            writer.wait()
        writer.close()
        assert drawn[-1] == 1 and (disk / "pytorch_res.png").exists()
        assert outputs.checkpoint_epoch(str(disk)) == 1 and len((disk / "pytorch_res.csv").read_text().split()) == 2


# ----------------------------------------------------------------------------- read-only places


def test_a_read_only_checkout_with_the_default_data_dir_is_one_line(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copy(Path(__file__).resolve().parent.parent / "train_distribute.py", checkout.mkdir() or checkout)
    with read_only(checkout):
        result = run_script(*TINY[1:], f"--output_dir={tmp_path / 'out'}", "--dataset=cifar10", cwd=checkout)
    line = one_line(result)
    assert line.startswith("error: DATA_DIR ./data cannot be created (Read-only file system); point --data_dir")


def test_a_read_only_data_dir_uses_its_decoded_copy_and_names_the_fix_when_there_is_none(tmp_path):
    """A first run writes the decoded copy beside the data; with DATA_DIR and HOME read-only (no XDG_CACHE_HOME), a
    run reads that copy without its lock file, and one that needs another copy (another size) is one line."""
    data, home = tmp_path / "data", tmp_path / "home"
    image_folder_of_noise(data, train=32, test=8, size=16)
    env = {k: v for k, v in clean_env(HOME=str(home)).items() if k != "XDG_CACHE_HOME"}
    first = run_script(*FOLDER, f"--data_dir={data}", f"--output_dir={tmp_path / 'first'}", env=env)
    assert first.returncode == 0, first.stderr
    with read_only(data), read_only(home):
        again = run_script(*FOLDER, f"--data_dir={data}", f"--output_dir={tmp_path / 'again'}", env=env)
        other = run_script(*FOLDER, "--image_size=12", f"--data_dir={data}", f"--output_dir={tmp_path / 'x'}", env=env)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    line = one_line(other)
    assert f"{data / '.decoded'}: not writable; {home / '.cache'}/resnet-ddp/" in line and "Read-only file" in line
    assert line.endswith(
        "set XDG_CACHE_HOME to a writable folder with room, or use --loader stream, which needs no copy"
    )


# ----------------------------------------------------------------------------- restarts and stops


def test_a_restart_whose_settings_changed_says_so_before_any_rank_starts(reference_run, tmp_path):
    """SLURM_RESTART_COUNT=1 (a requeued job) over the checkpoint of a 5-epoch run, now with --epochs 7: the user
    set no RESUME and cannot start a new run in the job's folder; the line says what to do, and nothing changes."""
    folder = tmp_path / "out"
    shutil.copytree(reference_run[0], folder)
    before = (folder / "checkpoint.pt").read_bytes()
    started = time.monotonic()
    result = run_script(*TINY, "--epochs=7", f"--output_dir={folder}", env=clean_env(SLURM_RESTART_COUNT="1"))
    line = one_line(result)
    assert line.startswith(f"error: this start is a restart (SLURM_RESTART_COUNT=1) of the run in {folder}, whose")
    assert "EPOCHS=5 where the settings now say 7" in line and "set EPOCHS back to 5 to continue it" in line
    assert result.stdout == "" and time.monotonic() - started < 30
    assert (folder / "checkpoint.pt").read_bytes() == before


@pytest.mark.parametrize("stop", ["ctrl_c", "sigterm"])
def test_a_stop_while_the_launcher_checks_the_images_is_one_line(tmp_path, stop):
    """Ctrl-C (to every process of the terminal) or SIGTERM to the launcher while it reads the images' headers:
    the launcher's one line, exit 130 or 75, within seconds, and nothing written."""
    image_folder_of_noise(tmp_path / "data", train=32, test=8, size=16)
    marker = tmp_path / "marker"
    env = clean_env(TEST_SLOW_HEADERS="3", TEST_MARKER=str(marker))
    run = launch(*FOLDER, f"--data_dir={tmp_path / 'data'}", f"--output_dir={tmp_path / 'out'}", env=env)
    deadline = time.monotonic() + HANG_TIMEOUT
    while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT) if stop == "ctrl_c" else os.kill(run.pid, signal.SIGTERM)
    started = time.monotonic()
    out, err = run.communicate(timeout=60)
    code, word = (130, "interrupted") if stop == "ctrl_c" else (75, "stopped by SIGTERM")
    line = one_line(subprocess.CompletedProcess([], run.returncode, out, err), code)
    assert line.startswith(f"{word}: ") and time.monotonic() - started < 10
    assert not (tmp_path / "out").exists()


def test_a_stop_that_python_drops_in_a_weakref_callback_still_stops_the_rank():
    """Under torchrun --max-restarts a killed worker's peers get SIGTERM; landing in a garbage collection's weakref
    callback, its exception was printed as "Exception ignored in ... WeakKeyDictionary" and lost."""
    result = call("tests.workers:stop_in_a_weakref_callback", timeout=60)
    assert one_line(result, 75).startswith("stopped by SIGTERM: ")


# ----------------------------------------------------------------------------- data that is odd, not wrong


def test_pillow_warnings_are_one_line_naming_a_file_and_never_make_an_image_unreadable(tmp_path, monkeypatch, capsys):
    """With warnings as errors (PYTHONWARNINGS=error), an image Pillow warns about (here: over a lowered limit on
    pixels) is used, and the warning is one line that names it; palette images raise none."""
    from PIL import Image

    image_folder_of_noise(tmp_path, train=4, test=0, size=16)
    Image.new("RGB", (40, 40)).save(tmp_path / "train" / "a" / "big.png")
    palette = Image.new("RGB", (16, 16), (200, 30, 30)).convert("P", palette=Image.ADAPTIVE, colors=8)
    palette.save(tmp_path / "train" / "b" / "palette.png", transparency=bytes(range(8)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 40 x 40 is over it, 16 x 16 under it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        image_folder.check_headers(str(tmp_path / "train"))
        pixels, _ = image_folder.decode(str(tmp_path / "train" / "b" / "palette.png"), 16)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: Pillow warned about 1 of 6 images in "), lines
    assert f"first {tmp_path / 'train' / 'a' / 'big.png'} (Image size (1600 pixels) exceeds limit" in lines[0]
    assert tuple(pixels[0, 0]) == (200, 30, 30)


def test_one_class_trains_with_one_line_of_warning(tmp_path):
    image_folder_of_noise(tmp_path / "data", train=32, test=8, size=16)
    for split in ("train", "test"):
        shutil.rmtree(tmp_path / "data" / split / "b")
    result = run_script(*FOLDER, f"--data_dir={tmp_path / 'data'}", f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: the data has one class (a)")]
    assert len(warned) == 1 and "put each class's images in a folder of its own" in warned[0]
