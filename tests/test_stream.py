"""The stream loader (LOADER="stream"): an image folder read from its files by DataLoader workers, in real rank
processes; and what both loaders share (sizes, decoding, statistics, the choice between them)."""

import json
import shutil
import warnings
from pathlib import Path

import image_folder
import numpy as np
import processes
import pytest
import torch
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

from tests.conftest import (
    HANG_TIMEOUT,
    SCRIPT,
    call,
    clean_env,
    csv_rows,
    image_folder_of_noise,
    run_script,
    start_torchrun,
    width,
)


def numbered_folder(root: Path, count: int, test: int = 10, size: int = 8) -> None:
    """`count` training images whose first two channels spell their number (number % 256, number // 256): the
    numbers follow the reader's order (class a's files, then class b's, each sorted by name)."""
    for split, n in (("train", count), ("test", test)):
        for number in range(n):
            folder = root / split / ("a" if number < n // 2 else "b")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.full((size, size, 3), 60, np.uint8)
            pixels[..., 0], pixels[..., 1] = number % 256, number // 256
            Image.fromarray(pixels).save(folder / f"{number:05d}.png")


def shuffled(images: int, rank: int, seed: int, epoch: int) -> list[int]:
    """The order torch's DistributedSampler gives `rank` of 2 (drop_last)."""
    sampler = DistributedSampler(range(images), 2, rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_every_image_is_used_once_an_epoch_in_an_order_that_changes_and_that_the_ranks_share(tmp_path):
    """And an evaluation reads every test image exactly once: 11 of them, 6 on rank 0 and 5 on rank 1."""
    numbered_folder(tmp_path / "images", 100, test=11)
    argv = ["--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", "--loader=stream", "--num_workers=1",
            "--image_size=8", "--batch_size=16", "--augment=False", "--seed=3"]  # fmt: skip
    assert call("tests.workers:start", "stream_order_worker", 2, argv, str(tmp_path)).returncode == 0
    drawn = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for epoch in ("1", "2"):
        shards = [theirs[epoch] for theirs in drawn]
        assert len(shards[0]) == len(shards[1]) == 48  # 6 steps of 8 images: 100 // 16 global batches
        assert len(set(shards[0]) | set(shards[1])) == 96  # no image twice; 4 sit this epoch out
        for rank, shard in enumerate(shards):  # one shuffle of SEED and the epoch, every rank its part of it
            assert shard == shuffled(100, rank, seed=3, epoch=int(epoch))[:48]
    assert drawn[0]["1"] != drawn[0]["2"] and drawn[1]["1"] != drawn[1]["2"]
    assert drawn[0]["test"] + drawn[1]["test"] == list(range(11))


def test_any_image_size_trains_on_both_loaders_and_auto_streams_what_does_not_fit(tmp_path):
    """30 and 33: sizes whose rows of bytes fill no whole words; a budget of 0 bytes makes `auto` stream."""
    image_folder_of_noise(tmp_path / "images", train=32, test=8, size=40)
    common = ["--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", *width(4), "--batch_size=8",
              "--num_workers=1"]  # fmt: skip
    runs = [[*common, "--image_size=30", "--loader=memory"], [*common, "--image_size=33", "--loader=memory"],
            [*common, "--image_size=30", "--loader=stream"], [*common, "--image_size=33", "--loader=auto"],
            [*common, "--dataset=synthetic", "--synthetic_size=32", "--image_size=30"],
            [*common, "--image_size=30", "--loader=stream", "--num_workers=0"]]  # fmt: skip
    out = tmp_path / "loaders.json"
    assert call("tests.workers:start", "loaders_worker", 2, runs, 0.0, str(out)).returncode == 0
    recorded = json.loads(out.read_text())
    loaders = [r["loader"].partition(" (")[0].partition(",")[0] for r in recorded]
    assert loaders == ["loader memory"] * 2 + ["loader stream"] * 2 + ["loader memory", "loader stream"]
    assert recorded[3]["loader"].startswith("loader stream (auto: ") and "GB free per rank" in recorded[3]["loader"]
    assert recorded[2]["loader"] == "loader stream, 1 worker(s) per rank"
    assert recorded[5]["loader"] == "loader stream, 0 worker(s) per rank"  # decoded in the rank's own process
    assert [r["image_size"] for r in recorded] == [30, 33, 30, 33, 30, 30]
    # both loaders give the same pixels, normalised with the statistics of the same sample: a run may switch
    for memory, stream in ((recorded[0], recorded[2]), (recorded[0], recorded[5]), (recorded[1], recorded[3])):
        assert memory["mean"] == stream["mean"] and memory["std"] == stream["std"]
        assert memory["identity"] == stream["identity"] and memory["test_pixels"] == stream["test_pixels"]


def test_16_bit_grey_and_palette_images_decode_to_their_own_colours(tmp_path):
    levels = (np.arange(64).reshape(8, 8) * 1024 + 3).astype(np.uint16)  # 3 .. 64515
    Image.fromarray(levels).save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode == "I;16"
    pixels, resized = image_folder.decode(str(tmp_path / "grey16.png"), 8)
    assert not resized and (pixels == np.round(levels / 257).astype(np.uint8)[..., None]).all()  # not all white
    palette = Image.new("P", (8, 8))
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (10, 20, 30)]
    palette.putpalette([value for colour in colours for value in colour])
    palette.putdata([i % 4 for i in range(64)])
    palette.save(tmp_path / "palette.png", transparency=3)  # colour 3 marked transparent
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and without Pillow's warning about palette transparency
        pixels, _ = image_folder.decode(str(tmp_path / "palette.png"), 8)
    assert (pixels.reshape(64, 3) == np.array(colours)[[i % 4 for i in range(64)]]).all()
    files = image_folder.ImageFiles([(str(tmp_path / "palette.png"), 1), (str(tmp_path / "gone.png"), 0)], 8)
    batch, labels, problems = files.__getitems__([0, 1])  # as a stream worker reads a batch
    assert (batch[0].numpy() == pixels).all() and labels.tolist() == [1, 0]
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path / 'gone.png'} (") and not batch[1].any()


def damaged_in_epoch_2(root: Path) -> tuple[Path, int]:
    """A training image of `root` that rank 1 of 2 reads in epoch 2 (global batch 16), but that no rank reads in
    epoch 1 and that is not among the 8 images statistics come from; its body cut off, its header whole (the
    check before training passes it); and the seed that orders the epochs so."""
    _, samples, _ = image_folder.list_images(str(root / "train"))
    image_folder.STATISTICS_SAMPLE, kept = 8, image_folder.STATISTICS_SAMPLE
    try:
        sample = set(image_folder.statistics_sample(len(samples)))
    finally:
        image_folder.STATISTICS_SAMPLE = kept
    for seed in range(20):
        epoch_1 = {i for rank in (0, 1) for i in shuffled(len(samples), rank, seed, 1)[:48]}
        candidates = set(shuffled(len(samples), 1, seed, 2)[:48]) - epoch_1 - sample
        if candidates:
            path = Path(samples[min(candidates)][0])
            path.write_bytes(path.read_bytes()[:200])
            return path, seed
    raise AssertionError("no seed reads an image first in epoch 2")


@pytest.mark.parametrize("launcher", ["spawned", "torchrun"])
def test_a_file_that_fails_to_decode_mid_run_stops_every_rank_in_one_line_naming_it(tmp_path, launcher):
    root, out = tmp_path / "images", tmp_path / "out"
    image_folder_of_noise(root, train=100, test=10, size=16)
    damaged, seed = damaged_in_epoch_2(root)
    args = ["--dataset=imagefolder", f"--data_dir={root}", "--loader=stream", "--image_size=16", *width(4),
            "--batch_size=16", "--epochs=3", f"--seed={seed}", f"--output_dir={out}"]  # fmt: skip
    env = clean_env(TEST_STATISTICS_SAMPLE="8")
    if launcher == "spawned":
        result = run_script(*args, env=env)
        code, errors, output = result.returncode, result.stderr.strip().splitlines(), result.stdout + result.stderr
        assert code == processes.EXIT_USER_ERROR and len(errors) == 1, output
    else:
        job = start_torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1", str(SCRIPT), *args, env=env)
        output = job.communicate(timeout=HANG_TIMEOUT)[0]
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert job.returncode != 0 and len(errors) == 1 and output.count("ResNet(") <= 1, output  # no restart
    assert errors[0].startswith(f"error: 1 of 100 images in {root}/train cannot be read: {damaged} (")
    kept = f"; put back good copies of the files as they were when the run started; the files in {out} are from epoch 1"
    assert kept in errors[0] and (launcher == "torchrun" or errors[0].endswith(": continue with --resume True"))
    assert "Traceback" not in output.partition(errors[0])[0]  # torchrun's own report follows ours (README)
    assert "Traceback" not in output or launcher == "torchrun"
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1 == csv_rows(out)


def test_a_damaged_header_is_found_before_training_and_nothing_is_written(tmp_path):
    image_folder_of_noise(tmp_path / "images", train=16, test=4, size=16)
    shutil.copy(SCRIPT, tmp_path / "not-an-image.png")  # a file of the right name and the wrong content
    shutil.move(tmp_path / "not-an-image.png", tmp_path / "images" / "test" / "b" / "broken.png")
    args = ["--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", "--loader=stream", "--batch_size=8"]
    result = run_script(*args, f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == processes.EXIT_USER_ERROR and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: 1 of 5 images in {tmp_path / 'images'}/test cannot be read")
    assert "broken.png (cannot identify image file" in result.stderr and "delete or replace it" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "images" / ".decoded").exists()


def test_a_run_moves_between_the_loaders_on_resume(tmp_path):
    """Started on memory, resumed on stream, and back: one data identity, whatever the loader (the checkpoint is
    cut back to epoch 1 before each resume, as if the run had stopped there)."""
    image_folder_of_noise(tmp_path / "images", train=32, test=8, size=16)
    out = tmp_path / "out"
    common = ["--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", "--image_size=16", *width(4),
              "--batch_size=8", f"--output_dir={out}", "--epochs=2"]  # fmt: skip
    for loader, resume in (("memory", "False"), ("stream", "True"), ("memory", "True"), ("stream", "True")):
        if resume == "True":
            saved = torch.load(out / "checkpoint.pt", weights_only=True)
            saved.update(epoch=1, history=saved["history"][:1])
            torch.save(saved, out / "checkpoint.pt")
        workers = "--num_workers=0" if resume == "True" and loader == "stream" and csv_rows(out) else "--num_workers=1"
        result = run_script(*common, f"--loader={loader}", f"--resume={resume}", workers)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert f"| loader {loader}" in result.stdout and csv_rows(out) == 2
        assert resume == "False" or "resuming after epoch 1 of 2" in result.stdout
