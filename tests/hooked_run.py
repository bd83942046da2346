"""train_distribute.py with a hook on checkpoint writes, in the launcher and in every spawned rank (a
spawned process runs this file's top level before it unpickles its worker). Tests use it to catch a run
in the middle of a background write, or to make a write fail as on a full disk.

    PYTHONPATH=. TEST_SLOW_EPOCH=2 TEST_MARKER=/path python tests/hooked_run.py ...  # epoch 2's write takes 4 s
    PYTHONPATH=. TEST_FAIL_EPOCH=2 python tests/hooked_run.py ...                     # epoch 2's write fails
"""

import errno
import os
import sys
import time
from pathlib import Path

import outputs
import train_distribute

_save_checkpoint = outputs.save_checkpoint


def hooked_save_checkpoint(state: dict, output_dir: str) -> None:
    epoch = state["epoch"]
    if epoch == int(os.environ.get("TEST_FAIL_EPOCH", "0")):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "checkpoint.pt"))
    if epoch == int(os.environ.get("TEST_SLOW_EPOCH", "0")):
        Path(os.environ["TEST_MARKER"]).write_text(str(epoch))  # the write has begun
        time.sleep(4)
    _save_checkpoint(state, output_dir)


outputs.save_checkpoint = hooked_save_checkpoint

if __name__ == "__main__":
    sys.exit(train_distribute.main(sys.argv[1:]))
