"""Worker functions for tests that start real rank processes, and the calls that start them (each called in a
process forked from the test server: tests.conftest.call). They live in a module of their own because a spawned
process finds its worker by importing the module that defines it."""

import json
import os
import signal
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import outputs
import processes
import torch
from torch import nn

import data
import distribute_tools
import muon
import train_distribute as td
from distribute_tools import cleanup, setup
from tests.conftest import read_config, width

# A tiny run: synthetic images, no augmentation noise between runs that are compared.
TINY_ARGS = ["--dataset=synthetic", "--synthetic_size=512", "--amp=False", "--augment=False", "--epochs=1"]
STEP_ARGS = [*TINY_ARGS, *width(4), "--batch_size=256"]


def start(worker_name: str, world_size: int, *args) -> int:
    """What conftest.call runs: the worker of this module on `world_size` ranks; the run's exit code."""
    return distribute_tools.run_distribute(globals()[worker_name], world_size, *args)


def report_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Writes what setup decided for this rank."""
    info = setup(rank, world_size, timeout_s=60)
    facts = {
        "rank": info.rank,
        "world_size": info.world_size,
        "device": str(info.device),
        "backend": info.backend,
        "threads": torch.get_num_threads(),
        "master_port": os.environ["MASTER_PORT"],
        "master_addr": os.environ["MASTER_ADDR"],
        "is_main": info.is_main,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(facts))
    cleanup(every_rank_leaves=True)


def raising_worker(rank: int, world_size: int) -> None:
    with distribute_tools.process_group(rank, world_size, 60):
        if rank == 1:
            raise RuntimeError("raised on purpose by the test")
        distribute_tools.all_ranks_meet()  # rank 0 waits for a rank that never comes


def hanging_worker(rank: int, world_size: int, timeout_s: float) -> None:
    with distribute_tools.process_group(rank, world_size, timeout_s):
        if rank == 1:
            time.sleep(600)  # stuck outside any collective (a deadlock, a stalled disk...)
        distribute_tools.all_ranks_meet()  # rank 0 waits in a collective: it must give up after timeout_s


def one_step(run: td.Run, global_batch: int, model: nn.Module | None = None) -> None:
    """One optimizer step of the project's train_step on this rank's share of the first global batch; with
    `model`, that network (wrapped in DDP like the project's) replaces the ResNet."""
    if model is not None:
        run.model = model
        run.ddp_model = nn.parallel.DistributedDataParallel(model)
        run.optimizer = td.make_optimizer(run.cfg, model, run.dist_info.device, run.bf16)
    info = run.dist_info
    x, y = next(run.train_data.train_batches(global_batch, info.world_size, info.rank, seed=0, epoch=1))
    assert len(y) == global_batch // info.world_size
    td.train_step(run, x, y, lr=0.05, loss_fn=nn.CrossEntropyLoss(), sums=torch.zeros(3))


def steps_worker(rank: int, world_size: int, variants: dict, global_batch: int, out: str) -> None:
    """One step of the project's code per variant {name: (extra settings, without_batchnorm)}, each from the same
    start; rank 0 saves the gradients, weights and BatchNorm statistics of each."""
    with distribute_tools.process_group(rank, world_size, 120) as info:
        results = {name: one_variant(info, *variant, global_batch) for name, variant in variants.items()}
        if info.is_main:
            torch.save(results, out)


def one_variant(info: distribute_tools.DistInfo, extra: list, without_batchnorm: bool, global_batch: int) -> dict:
    """One step of a variant: its gradients, weights and BatchNorm statistics. Its run (and DDP's reducer, which
    holds the group) ends with this call, before the group is left: a reducer freed after it would join the
    group's threads while they wait for the interpreter lock."""
    run = td.build_run(read_config([*STEP_ARGS, *extra]), info, launched_at=time.time())
    plain = None
    if without_batchnorm:
        torch.manual_seed(0)
        plain = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
        )
    one_step(run, global_batch, plain)
    grads = {f"grad.{key}": p.grad.detach().clone() for key, p in run.model.named_parameters()}
    return {**grads, **{key: v.detach().clone() for key, v in run.model.state_dict().items()}}


def widths_worker(rank: int, world_size: int, widths: list, settings: list, out: str) -> None:
    """An epoch and an evaluation of the project's code at each width: no width may crash a rank."""
    with distribute_tools.process_group(rank, world_size, 120) as info:
        finished = []
        for width in widths:
            train_and_evaluate(read_config([*TINY_ARGS, f"--width={width}", *settings]), info)
            finished.append(width)
        if info.is_main:
            Path(out).write_text(json.dumps(finished))


def train_and_evaluate(cfg: SimpleNamespace, info: distribute_tools.DistInfo, run: td.Run | None = None) -> dict:
    """An epoch and an evaluation; the run ends with this call, before the group is left (see one_variant),
    unless it was given. Returns what the run recorded of its data."""
    run = run or td.build_run(cfg, info, launched_at=time.time())
    (loss_sum, _, images), _, _ = td.train_epoch(run, epoch=1)
    _, acc = td.evaluate(run)
    assert loss_sum / images > 0 and 0 <= acc <= 1
    return run.data


def loaders_worker(rank: int, world_size: int, argvs: list, memory_share: float, out: str) -> None:
    """An epoch and an evaluation of each run (a list of settings), with data.MEMORY_SHARE as given: rank 0 writes
    which loader each run used and the statistics it normalised with."""
    data.MEMORY_SHARE = memory_share
    with distribute_tools.process_group(rank, world_size, 120) as info:
        chosen = [loader_facts(read_config(argv), info) for argv in argvs]
        if info.is_main:
            Path(out).write_text(json.dumps(chosen))


def loader_facts(cfg: SimpleNamespace, info: distribute_tools.DistInfo) -> dict:
    """What the run recorded of its data, after an epoch and an evaluation; and the sum of this rank's
    normalised test images as the loader gives them. The run ends with this call, before the group is left."""
    run = td.build_run(cfg, info, launched_at=time.time())
    recorded = train_and_evaluate(cfg, info, run)
    pixels = sum(x.double().sum().item() for x, _ in run.test_data.eval_batches(info.world_size, info.rank))
    return {**recorded, "test_pixels": pixels}


def stream_order_worker(rank: int, world_size: int, argv: list, out: str) -> None:
    """Rank by rank, the numbers of the images (tests.test_stream.numbered_folder) that two epochs of the stream
    loader give, in order."""
    with distribute_tools.process_group(rank, world_size, 120) as info:
        Path(out, f"rank{rank}.json").write_text(json.dumps(numbers_drawn(read_config(argv), info)))


def numbers_drawn(cfg: SimpleNamespace, info: distribute_tools.DistInfo) -> dict[str, list[int]]:
    """Per training epoch, and for an evaluation ("test"). The loaders end with this call, before the group is
    left."""
    train, test, _ = data.load(cfg, info)

    def numbers(loader, batches) -> list[int]:
        pixels = torch.cat([x[:, :, 0, 0] * loader.std[:, :, 0, 0] + loader.mean[:, :, 0, 0] for x, _ in batches])
        return (pixels[:, 0].round() + 256 * pixels[:, 1].round()).long().tolist()

    epochs = range(1, 3)
    drawn = {str(e): numbers(train, train.train_batches(cfg.BATCH_SIZE, info.world_size, info.rank, cfg.SEED, e))
             for e in epochs}  # fmt: skip
    return {**drawn, "test": numbers(test, test.eval_batches(info.world_size, info.rank))}


def evaluate_worker(rank: int, world_size: int, argv: list, out_path: str) -> None:
    """Evaluates the checkpoint in OUTPUT_DIR with the project's evaluate()."""
    with distribute_tools.process_group(rank, world_size, 120) as info:
        result = evaluate_checkpoint(read_config(argv), info)
        if info.is_main:
            Path(out_path).write_text(json.dumps(result))


def evaluate_checkpoint(cfg: SimpleNamespace, info: distribute_tools.DistInfo) -> dict:
    """The run ends with this call, before the group is left (see one_variant)."""
    run = td.build_run(cfg, info, launched_at=time.time())
    run.model.load_state_dict(outputs.load_checkpoint(cfg.OUTPUT_DIR)["model"])
    loss, acc = td.evaluate(run)
    return {"loss": loss, "acc": acc, "images": len(run.test_data)}


# ----------------------------------------------------------------------------- small calls (tests.conftest.call)


def die_with_parent_1() -> int:
    """A process whose launcher (pid 1 here) is gone before it asks to die with it: it must leave at once."""
    processes.die_with_parent(1)
    print("still here")
    return 0


def hold_output_dir(folder: str, seconds: float, marker: str) -> int:
    """Another run holding `folder` for `seconds`; the marker file says that it holds it."""
    import resume

    with resume.lock_output_dir(folder):
        Path(marker).write_text("held")
        time.sleep(seconds)
    return 0


def write_one_checkpoint(folder: str) -> int:
    """The writer saving a 800 kB checkpoint; prints its one-line error, if any."""
    writer = outputs.ResultWriter(folder)
    writer.submit({"model": {"w": torch.zeros(200_000)}, "epoch": 1}, [{"epoch": 1, "acc": 0.5, "loss": 1.0}])
    try:
        writer.wait()
    except processes.UserError as error:
        print(error)
    writer.close()
    return 0


def muon_steps(seed: int = 0) -> list[torch.Tensor]:
    """Three Muon steps on filter banks of several shapes (wide, tall, 1x1) and a bias, from seeded gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (32, 8, 1, 1), (24, 16, 3, 3), (16,)]
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]
    optimizer = muon.MuonSGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4, muon_scale=0.2, bf16=False)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach() for p in params]


def muon_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Muon's steps in a process group, where each rank orthogonalises a share of the filter banks."""
    with distribute_tools.process_group(rank, world_size, 60):
        torch.save(muon_steps(), Path(out_dir, f"rank{rank}.pt"))


def torchrun_that_drops_a_sigterm(out: str) -> int:
    """Stands in for torchrun with restarts left whose first SIGTERM is lost (as one landing while it forks a
    worker is): a worker that refuses to start must ask again, and stay until this parent ends it."""
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(time.monotonic()))
    worker = os.fork()
    if worker == 0:
        os.environ.update(TORCHELASTIC_RUN_ID="test", TORCHELASTIC_MAX_RESTARTS="2", LOCAL_RANK="0")
        os._exit(processes.report(processes.UserError("a mistake"), rank=0))
    deadline = time.monotonic() + 30
    while len(received) < 2 and time.monotonic() < deadline:  # the first is "lost": ignored here
        time.sleep(0.01)
    worker_alive = os.waitpid(worker, os.WNOHANG) == (0, 0)
    os.kill(worker, signal.SIGTERM)  # what torchrun does with its workers when it stops
    status = os.waitpid(worker, 0)[1]
    facts = {"sigterms": len(received), "worker_alive": worker_alive, "worker_end": os.waitstatus_to_exitcode(status)}
    Path(out).write_text(json.dumps(facts))
    return 0


def stop_in_a_weakref_callback() -> int:
    """A rank whose SIGTERM lands while Python runs a weakref callback (as in a garbage collection), where Python
    prints the exception as "Exception ignored" and drops it: the rank must still stop, with exit 75."""

    def work(rank: int, world_size: int) -> None:
        processes.handle_stop_signals()

        def callback(reference) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1_000_000))  # the signal's handler runs in here

        thing = torch.nn.Module()  # any object that takes weak references
        reference = weakref.ref(thing, callback)  # noqa: F841  (kept alive until the end)
        del thing
        time.sleep(10)  # only a stop raised again ends this early

    return processes.run_rank(0, work, 1, ())
