"""Hooks for tests that catch a run in the middle of a background write, make a write fail as on a full disk, or
break a rank or the network. The test server installs them in every run it starts (they act only where the run's
environment asks, and ranks forked from the launcher inherit them):

    TEST_PIDS=/folder                     each rank records its process id there, as rank<N>.pid
    TEST_SLOW_EPOCH=2 TEST_MARKER=/path   epoch 2's checkpoint write waits 2 s, or until a stop signal reaches the rank
                                          or it closes the writer (it ends); the marker file says the write began
    TEST_FAIL_EPOCH=2                     epoch 2's checkpoint write fails as on a full disk
    TEST_RANK_1_BUG=1                     rank 1 raises RuntimeError as it builds its run, before training
    TEST_DROPOUT=0.3                      make_model's network gets dropout on its input: randomness in forward
    TEST_OWN_NETWORK=8                    the template's own ResNet of this width, whatever make_model returns now
    TEST_PROGRESS_SECONDS=0               an epoch's progress line in a log file this often (a minute otherwise)
    TEST_OUT_OF_MEMORY=2                  rank 0 runs out of GPU memory (torch's error) as epoch 2 begins
    TEST_STREAM=1                         image folders stream from their files, as those too large for memory do

Every rank of a test that still runs after HANG_DUMP seconds prints the stacks of its threads to its stderr (a hang
that comes once in many runs is found in the failed test's output).

Run as torchrun's script (`torchrun ... tests/hooked_run.py ARGS`, forked from the test server), it is
train_distribute.py with those hooks.
"""

import errno
import faulthandler
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import data
import train_distribute
from resnet import ResNet
from safeguards import failures, files

OUT_OF_MEMORY = (  # as torch says it, where another process holds most of the GPU's memory
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.12 GiB is "
    "free. Process 4242 has 120.00 GiB memory in use. Of the allocated memory 17.50 GiB is allocated by PyTorch (test)"
)


HANG_DUMP = 200  # seconds: a test's rank alive this long hangs (the tests wait 240 s): every thread's stack on stderr


def install_hooks() -> None:
    run_rank = failures.run_rank
    write, close, build_run, make_model, main_worker, train_epoch = (
        files.ResultWriter._write,
        files.ResultWriter.close,
        train_distribute.build_run,
        train_distribute.make_model,
        train_distribute.main_worker,
        train_distribute.train_epoch,
    )

    def hooked_write(self, snapshot: dict, history: list) -> None:
        epoch = snapshot["epoch"]
        if epoch == int(os.environ.get("TEST_FAIL_EPOCH", "0")):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.output_dir, "checkpoint.pt"))
        if epoch == int(os.environ.get("TEST_SLOW_EPOCH", "0")):
            Path(os.environ["TEST_MARKER"]).write_text(str(epoch))  # the write has begun
            slow_until = time.monotonic() + 2
            while time.monotonic() < slow_until and not (failures._received or getattr(self, "closing", False)):
                time.sleep(0.01)  # the rank's ending, not a fixed time, ends the wait: the run waits for these files
        write(self, snapshot, history)

    def hooked_close(self) -> None:
        self.closing = True
        close(self)

    def hooked_build_run(cfg, info):
        if info.rank == 1 and os.environ.get("TEST_RANK_1_BUG"):
            raise RuntimeError("a bug on rank 1, raised on purpose by the test")
        return build_run(cfg, info)

    def hooked_make_model(cfg, num_classes: int) -> nn.Module:
        own = os.environ.get("TEST_OWN_NETWORK")
        return with_dropout(ResNet(int(own), num_classes) if own else make_model(cfg, num_classes))

    def hooked_train_epoch(run, epoch: int):
        if run.info.rank == 0 and epoch == int(os.environ.get("TEST_OUT_OF_MEMORY", "0")):
            raise torch.cuda.OutOfMemoryError(OUT_OF_MEMORY)
        return train_epoch(run, epoch)

    def hooked_run_rank(body) -> int:
        faulthandler.dump_traceback_later(HANG_DUMP)  # (a rare hang, found in a failed test's output)
        return run_rank(body)

    def hooked_main_worker(cfg) -> None:
        if os.environ.get("TEST_PIDS"):
            Path(os.environ["TEST_PIDS"], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
        main_worker(cfg)

    if os.environ.get("TEST_STREAM"):
        data.MEMORY_SHARE = 0.0
    if os.environ.get("TEST_PROGRESS_SECONDS"):
        files.PROGRESS_EVERY = float(os.environ["TEST_PROGRESS_SECONDS"])
    files.ResultWriter._write = hooked_write
    files.ResultWriter.close = hooked_close
    train_distribute.build_run = hooked_build_run
    train_distribute.make_model = hooked_make_model
    train_distribute.main_worker = hooked_main_worker
    failures.run_rank = hooked_run_rank
    train_distribute.train_epoch = hooked_train_epoch


def with_dropout(model: nn.Module) -> nn.Module:
    """TEST_DROPOUT: the network with dropout on its input (randomness in its forward); else the network."""
    dropout = os.environ.get("TEST_DROPOUT")
    return nn.Sequential(nn.Dropout(float(dropout)), model) if dropout else model


def edited_copy(path: str, *argv: str) -> int:
    """`python PATH *argv`, PATH a copy of train_distribute.py that a test edited (call it from the test server): its
    ranks forked from it. The files' hooks act, and TEST_DROPOUT; the others act on the original alone."""
    spec = importlib.util.spec_from_file_location("edited_train_distribute", path)
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # the copy reads its settings from itself
    spec.loader.exec_module(module)
    make_model = module.make_model
    module.make_model = lambda cfg, num_classes: with_dropout(make_model(cfg, num_classes))
    return module.main(list(argv), entrypoint=module.main)


if __name__ == "__main__":  # torchrun's script in a test: train_distribute.py with the hooks the test server installed
    sys.exit(train_distribute.main(sys.argv[1:]))
