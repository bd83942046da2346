"""Worker functions for tests that start real processes. They live in a module of their own because
spawned processes find a worker by importing the module that defines it."""
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import train_distribute as td
from data import DeviceLoader, make_synthetic
from distribute_tools import barrier, cleanup, setup
from outputs import load_checkpoint


def report_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Writes what setup decided for this rank."""
    d = setup(rank, world_size, timeout_s=60)
    facts = {"rank": d.rank, "world_size": d.world_size, "device": str(d.device), "backend": d.backend,
             "threads": torch.get_num_threads(), "master_port": os.environ["MASTER_PORT"],
             "master_addr": os.environ["MASTER_ADDR"], "is_main": d.is_main}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(facts))
    cleanup(finished=True)


def raising_worker(rank: int, world_size: int) -> None:
    setup(rank, world_size, timeout_s=60)
    try:
        if rank == 1:
            raise RuntimeError("raised on purpose by the test")
        barrier()  # rank 0 waits for a rank that never comes
    finally:
        cleanup(finished=False)


def hanging_worker(rank: int, world_size: int, timeout_s: float) -> None:
    setup(rank, world_size, timeout_s=timeout_s)
    if rank == 1:
        time.sleep(600)  # stuck outside any collective (a deadlock, a stalled disk...)
    barrier()  # rank 0 waits in a collective: it must give up after timeout_s


def gradient_step_worker(rank: int, world_size: int, global_batch: int, out_path: str) -> None:
    """Two optimizer steps of a network without BatchNorm on this rank's share of each global batch,
    through the project's loader and train_step; rank 0 saves the resulting weights."""
    d = setup(rank, world_size, timeout_s=60)
    cfg = td.read_config(["--optimizer=sgd", "--weight_decay=5e-4", "--momentum=0.9", "--amp=False"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).to(memory_format=torch.channels_last)
    loader = DeviceLoader(make_synthetic(4 * global_batch, seed=0, split=0), d.device, augment=False)
    t = td.Training(cfg, d, model, DistributedDataParallel(model), td.make_optimizer(cfg, model, d.device),
                    loader, loader, bf16=False)
    batches = loader.train_batches(global_batch, world_size, rank, seed=0, epoch=1)
    for _, (x, y) in zip(range(2), batches):
        assert len(y) == global_batch // world_size
        td.train_step(t, x, y, lr=0.05, loss_fn=nn.CrossEntropyLoss())
    if d.is_main:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_path)
    cleanup(finished=True)


def evaluate_worker(rank: int, world_size: int, argv: list, out_path: str) -> None:
    """Evaluates the checkpoint in OUTPUT_DIR with the project's evaluate()."""
    cfg = td.read_config(argv)
    d = setup(rank, world_size, timeout_s=60)
    t = td.build_training(cfg, d)
    td.restore(t, load_checkpoint(cfg.OUTPUT_DIR))
    loss, acc = td.evaluate(t)
    if d.is_main:
        Path(out_path).write_text(json.dumps({"loss": loss, "acc": acc, "images": len(t.test_data)}))
    cleanup(finished=True)
