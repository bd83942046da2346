"""Hooks on checkpoint writes for tests that catch a run in the middle of a background write, or make a write fail
as on a full disk, and on the row, as a user adding a column would change it. The test server installs them in every
run it starts (they act only where the run's environment asks, and ranks forked from the launcher inherit them):

    TEST_SLOW_EPOCH=2 TEST_MARKER=/path   epoch 2's checkpoint write takes 2 s; the marker file says it began
    TEST_FAIL_EPOCH=2                     epoch 2's checkpoint write fails as on a full disk
    TEST_WRITE_BUG_EPOCH=2                epoch 2's CSV write raises ValueError, as a bug in the writer would
    TEST_ROW_KEY=name                     each row gets name = the epoch / 2 as a numpy number
    TEST_NEW_COLUMN=name                  outputs.COLUMNS gets a column of that name (CSV only)
    TEST_UNUSED_LAYER=1                   make_model's network gets a layer that its forward never uses
    TEST_RANK_1_BUG=1                     rank 1 raises RuntimeError as it loads the data, before training
    TEST_STATISTICS_SAMPLE=8              the stream loader's statistics come from 8 images (the others are
                                          first decoded in training)
    TEST_MEMORY_SHARE=0                   LOADER=auto streams any image folder (as if the device were too small)
    TEST_SLOW_HEADERS=2 TEST_MARKER=/path the check of the images' headers takes 2 s more; the marker says it began
"""

import errno
import os
import time
from pathlib import Path

import outputs

_save_checkpoint, _write_csv, _checked_row = outputs.save_checkpoint, outputs.write_csv, outputs.checked_row


def hooked_save_checkpoint(state: dict, output_dir: str) -> None:
    epoch = state["epoch"]
    if epoch == int(os.environ.get("TEST_FAIL_EPOCH", "0")):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "checkpoint.pt"))
    if epoch == int(os.environ.get("TEST_SLOW_EPOCH", "0")):
        Path(os.environ["TEST_MARKER"]).write_text(str(epoch))  # the write has begun
        time.sleep(2)
    _save_checkpoint(state, output_dir)


def hooked_write_csv(history: list, output_dir: str) -> None:
    if len(history) == int(os.environ.get("TEST_WRITE_BUG_EPOCH", "0")):
        raise ValueError("dict contains fields not in fieldnames: 'surprise'")
    _write_csv(history, output_dir)


def hooked_checked_row(row: dict) -> dict:
    if "TEST_ROW_KEY" in os.environ:
        import numpy

        row[os.environ["TEST_ROW_KEY"]] = numpy.float64(row["epoch"] / 2)  # not a plain float: weights_only refuses it
    return _checked_row(row)


def install_hooks() -> None:
    if any(name.startswith("TEST_") for name in os.environ):
        outputs.save_checkpoint, outputs.write_csv = hooked_save_checkpoint, hooked_write_csv
        outputs.checked_row = hooked_checked_row
    if "TEST_UNUSED_LAYER" in os.environ:
        import torch

        import train_distribute

        make_model = train_distribute.make_model

        def with_unused_layer(cfg, num_classes: int) -> torch.nn.Module:
            model = make_model(cfg, num_classes)
            model.register_parameter("unused", torch.nn.Parameter(torch.zeros(2)))
            return model

        train_distribute.make_model = with_unused_layer
    if "TEST_RANK_1_BUG" in os.environ:
        import data

        load = data.load

        def buggy_load(cfg, dist_info, *args):
            if dist_info.rank == 1:
                raise RuntimeError("a bug in rank 1")
            return load(cfg, dist_info, *args)

        data.load = buggy_load
    if "TEST_STATISTICS_SAMPLE" in os.environ:
        import image_folder

        image_folder.STATISTICS_SAMPLE = int(os.environ["TEST_STATISTICS_SAMPLE"])
    if "TEST_MEMORY_SHARE" in os.environ:
        import data

        data.MEMORY_SHARE = float(os.environ["TEST_MEMORY_SHARE"])
    if "TEST_SLOW_HEADERS" in os.environ:
        import image_folder

        header_chunk = image_folder._header_chunk

        def slow_header_chunk(job):
            Path(os.environ["TEST_MARKER"]).write_text("headers")
            time.sleep(float(os.environ["TEST_SLOW_HEADERS"]))
            return header_chunk(job)

        image_folder._header_chunk = slow_header_chunk
    if "TEST_NEW_COLUMN" in os.environ:
        outputs.COLUMNS[os.environ["TEST_NEW_COLUMN"]] = ("a column a test added", None)
