"""Which checkpoint a run continues, and one run per OUTPUT_DIR. The training script calls:

    resume.all_ranks_finished(cfg, dist_info)       on every rank, first: a restart of a complete run does nothing
    resume.check_before_start(cfg)                  in the launcher: OUTPUT_DIR usable and free; with
                                                    --resume, a readable checkpoint of the same settings
    with resume.start(cfg, dist_info, data, model, optimizer) as history:   on every rank: a new run moves
                                                    earlier results aside and gets []; a resumed one gets its
                                                    weights and optimizer state, and the rows of its epochs
    resume.run_ids()                                what a checkpoint is saved under

Which checkpoint: RESUME=True continues the one in OUTPUT_DIR; a run restarted by torchrun or SLURM continues
its own run's newest checkpoint by itself. OUTPUT_DIR may be a local disk: each machine says which epoch its
folder holds, and global rank 0 (wherever it now is) receives the newest and writes from then on.
"""

import glob
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from types import SimpleNamespace
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

import config
import outputs
import processes
from data import same_data
from distribute_tools import DistInfo, all_ranks_try, under_torchrun
from processes import UserError

LOCK_NAME = ".lock"


def run_ids() -> dict[str, str]:
    """Every name of this run that survives a restart (torchrun's run id, SLURM's job id): a checkpoint
    carries them, so that a restart continues its own run's checkpoint and no other."""
    names = {"torchrun": "TORCHELASTIC_RUN_ID", "slurm": "SLURM_JOB_ID"}
    return {kind: os.environ[name] for kind, name in names.items() if os.environ.get(name)}


def all_ranks_finished(cfg: SimpleNamespace, dist_info: DistInfo) -> bool:
    """Every rank: whether this start has nothing to do (see finished_here). One machine's OUTPUT_DIR is enough,
    since it may be each machine's own disk; rank 0 says so once."""
    everyone: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(everyone, dist_info.local_rank == 0 and finished_here(cfg))
    if any(everyone) and dist_info.is_main:
        print(f"already finished: all {cfg.EPOCHS} epochs are in {cfg.OUTPUT_DIR}; nothing to do", flush=True)
    return any(everyone)


def finished_here(cfg: SimpleNamespace) -> bool:
    """A resume, or a restart by torchrun or SLURM (a requeue that came too late, say), of a run whose checkpoint
    here holds all its epochs with these settings. Such a start touches nothing, not even the lock. A restart of
    the run here with other settings is refused now, before any rank starts, where this machine holds every rank."""
    if not (cfg.RESUME or processes.restart_count() > 0):
        return False
    saved = _read(cfg.OUTPUT_DIR, strict=False)
    if saved is None:
        return False
    alone = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")  # both unset in the launcher
    if not cfg.RESUME and alone and _is_this_run(saved.get("run_ids", {})):
        config.check_resume(saved["config"], cfg, processes.restarted_by())
    try:
        config.check_resume(saved["config"], cfg)
    except UserError:
        return False  # other settings: the start refuses them in its own words
    return int(saved["epoch"]) >= cfg.EPOCHS


def _is_this_run(saved_by: dict[str, str]) -> bool:
    """Whether a checkpoint is this run's, by the run ids it was saved under (run_ids); one saved without any is."""
    ours = run_ids()
    return not ours or any(saved_by.get(kind) == name for kind, name in ours.items())


def check_before_start(cfg: SimpleNamespace) -> None:
    """OUTPUT_DIR is (or can become) a writable folder that no other run holds, and a --resume finds a
    checkpoint of the same settings. Creates nothing. The launcher learns what a failed run keeps."""
    folder = os.path.abspath(cfg.OUTPUT_DIR)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"OUTPUT_DIR {cfg.OUTPUT_DIR} cannot be a folder: {existing} is a file; choose another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"OUTPUT_DIR {cfg.OUTPUT_DIR} is not writable ({existing}); choose another --output_dir")
    if os.path.exists(os.path.join(folder, LOCK_NAME)):
        lock_output_dir(cfg.OUTPUT_DIR, same_run_wait_s=0).close()
    if cfg.RESUME and processes.restart_count() == 0:
        config.check_resume(_read(cfg.OUTPUT_DIR)["config"], cfg)
    resumed, earlier = cfg.RESUME or processes.restart_count() > 0, _checkpoint_stamp(cfg.OUTPUT_DIR)
    # the launcher's line after a rank fails: a checkpoint this run has not replaced is an earlier run's
    processes.tell_kept_files(
        lambda: _resume_hint(cfg.OUTPUT_DIR, resumed or _checkpoint_stamp(cfg.OUTPUT_DIR) != earlier)
    )


@contextmanager
def start(
    cfg: SimpleNamespace, dist_info: DistInfo, data: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[list[dict[str, float]]]:
    """Rank 0 holds OUTPUT_DIR's lock for the whole run (another run's lock stops every rank). A resumed run's
    model and optimizer get the checkpoint's state; yields the rows of the epochs already done ([] for a new
    run). `data`: what identifies the data the run trains on; a checkpoint of other data is refused. A stop
    or failure ends with a line naming the epoch whose files are kept."""
    lock = all_ranks_try(lambda: lock_output_dir(cfg.OUTPUT_DIR) if dist_info.is_main else None)
    try:
        checkpoint, source = _newest_checkpoint(cfg, dist_info)
        saved = checkpoint.get("data", {}).get("identity", "none recorded") if checkpoint else data["identity"]
        if not same_data(saved, data["identity"]):
            raise UserError(
                f"the checkpoint in {cfg.OUTPUT_DIR} was trained on other data ({saved}, now {data['identity']}); "
                f"resume on the same data, or start a new run without --resume"
            )
        if saved != data["identity"] and dist_info.is_main:
            print("warning: the checkpoint's data was recorded by an earlier version; compared by count and size only")
        if checkpoint:
            _check_same_network(checkpoint["model"], model.state_dict(), cfg.OUTPUT_DIR)
        if dist_info.is_main:
            _prepare_output_dir(cfg, checkpoint, source)
            processes.tell_kept_files(lambda: _resume_hint(cfg.OUTPUT_DIR))  # every file here is this run's now
        try:
            yield _restore(checkpoint, model, optimizer) if checkpoint else []
        finally:
            if dist_info.is_main:  # a stop signal may have cut train()'s close() off: the files before the line
                outputs.finish_writers()  # that names their epoch (processes.report)
    finally:
        if lock is not None:
            lock.close()  # releases it


def _check_same_network(saved: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], output_dir: str) -> None:
    """Every rank alike, before anything is changed: the checkpoint's weights are this network's, name by name."""
    for name in [*saved, *(n for n in mine if n not in saved)]:
        theirs, ours = saved.get(name), mine.get(name)
        if theirs is None or ours is None or theirs.shape != ours.shape:
            shapes = [tuple(t.shape) if t is not None else "none" for t in (theirs, ours)]
            raise UserError(
                f"the checkpoint in {output_dir} is of another network: its {name} is {shapes[0]}, this network's "
                f"{shapes[1]}; resume with the network that wrote it, or start a new run in another --output_dir"
            )


def _restore(checkpoint: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, float]]:
    model.load_state_dict(checkpoint["model"])
    for saved, current in zip(checkpoint["optimizer"]["param_groups"], optimizer.param_groups, strict=True):
        saved.update(fused=current.get("fused"), foreach=current.get("foreach"))  # this machine's kernels
    optimizer.load_state_dict(checkpoint["optimizer"])
    return list(checkpoint["history"])


def _newest_checkpoint(cfg: SimpleNamespace, dist_info: DistInfo) -> tuple[dict[str, Any] | None, int]:
    """With RESUME, or after a restart: the newest checkpoint on any machine, read where it lies (once) and
    sent to every rank, and the rank it came from. Every rank takes part: whether this is a restart is
    decided from what all ranks know."""
    here = dist_info.local_rank == 0 and os.path.isfile(os.path.join(cfg.OUTPUT_DIR, outputs.CHECKPOINT_NAME))
    strict = cfg.RESUME or dist_info.restarted  # a restart never starts over in silence on a checkpoint it cannot read
    mine = all_ranks_try(lambda: _read(cfg.OUTPUT_DIR, strict=strict) if here else None)
    epoch, saved_by = (int(mine["epoch"]), mine.get("run_ids", {})) if mine else (-1, {})
    everyone: list[Any] = [None] * dist_info.world_size
    dist.all_gather_object(everyone, (epoch, saved_by, dist_info.restarted))
    restarted = any(flag for _, _, flag in everyone)
    if not (cfg.RESUME or restarted):
        return None, 0
    # a restart continues its own run only: another machine may hold an older run's checkpoint
    same_run = [cfg.RESUME or _is_this_run(saved_by) for _, saved_by, _ in everyone]
    epochs = [e if same else -1 for (e, _, _), same in zip(everyone, same_run, strict=True)]
    if max(epochs) < 0:
        if restarted:
            return None, 0  # restarted before its first checkpoint: it starts again
        raise UserError(_no_checkpoint_message(cfg.OUTPUT_DIR))
    source = epochs.index(max(epochs))
    shared = [mine if dist_info.rank == source else None]
    dist.broadcast_object_list(shared, src=source)
    config.check_resume(shared[0]["config"], cfg, "" if cfg.RESUME else processes.restarted_by())  # all alike
    return shared[0], source


def _read(output_dir: str, strict: bool = True) -> dict[str, Any] | None:
    """The checkpoint in output_dir, its tensors read when first used. strict: a missing or unreadable one is
    a UserError; otherwise None."""
    path = os.path.join(output_dir, outputs.CHECKPOINT_NAME)
    try:
        return outputs.load_checkpoint(output_dir, lazily=True)
    except Exception as e:
        if not strict:
            return None
        if not os.path.isfile(path):
            raise UserError(_no_checkpoint_message(output_dir)) from None
        raise UserError(
            f"cannot read {path} ({type(e).__name__}: {processes.first_line(e, 80)}); it stays as it is: put back "
            f"a good copy to continue, or move it away to start the run over"
        ) from None


def _prepare_output_dir(cfg: SimpleNamespace, checkpoint: dict[str, Any] | None, source: int) -> None:
    """Rank 0: a new run moves earlier results aside; a resumed one rewrites the CSV from its checkpoint (rows
    written after it belong to an epoch that runs again), and keeps a checkpoint from another machine here."""
    folder = cfg.OUTPUT_DIR
    remove_temporaries(folder)
    if checkpoint is None or source != 0:
        moved = move_aside(folder)
        whose = "older" if checkpoint else "earlier run's"
        if moved:
            print(f"moved the {whose} results in {folder} to {moved}")
    if checkpoint is not None:
        if source != 0:
            outputs.save_checkpoint(checkpoint, folder)
        outputs.write_csv(checkpoint["history"], folder)
        where = f" (the checkpoint of rank {source}'s machine)" if source else ""
        print(f"resuming after epoch {checkpoint['epoch']} of {cfg.EPOCHS}{where}", flush=True)


def remove_temporaries(output_dir: str) -> None:
    """Temporary files of a run killed in mid-write: never complete, never needed."""
    for name in os.listdir(output_dir):
        if name.startswith(tuple(f"{result}.tmp" for result in outputs.RESULT_FILES)):
            os.remove(os.path.join(output_dir, name))


def _resume_hint(output_dir: str, ours: bool = True) -> str:
    """What a stopped or failed run leaves to continue from, once its files are finished. `ours`: the
    checkpoint there is this run's (not an earlier run's that a new run had yet to move aside)."""
    epoch = outputs.checkpoint_epoch(output_dir) if ours else 0
    if not epoch:
        return "no epoch had finished, so there is nothing to resume; start the run again"
    if under_torchrun():
        return (
            f"the files in {output_dir} are from epoch {epoch}; a torchrun restart or requeue continues from "
            f"them by itself, a new torchrun command with --resume True"
        )
    return f"the files in {output_dir} are from epoch {epoch}: continue with --resume True"


def _checkpoint_stamp(output_dir: str) -> tuple[int, int] | None:
    """Which file the checkpoint is (None: there is none): every write replaces it with a new file."""
    path = os.path.join(output_dir, outputs.CHECKPOINT_NAME)
    stat = os.stat(path) if os.path.exists(path) else None
    return (stat.st_ino, stat.st_mtime_ns) if stat else None


def move_aside(output_dir: str) -> str | None:
    """A new run never overwrites an earlier one: its files move to OUTPUT_DIR/previous-<time>/."""
    found = [name for name in outputs.RESULT_FILES if os.path.exists(os.path.join(output_dir, name))]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(output_dir, found[0]))))
    destination, suffix = os.path.join(output_dir, f"previous-{stamp}"), 1
    while os.path.exists(destination):
        suffix += 1
        destination = os.path.join(output_dir, f"previous-{stamp}-{suffix}")
    os.makedirs(destination)
    for name in found:
        shutil.move(os.path.join(output_dir, name), os.path.join(destination, name))
    return destination


def _no_checkpoint_message(output_dir: str) -> str:
    """RESUME=True found nothing to resume: say where a later run moved the last checkpoint, if it did."""
    moved = glob.glob(os.path.join(glob.escape(output_dir), "previous-*", outputs.CHECKPOINT_NAME))
    latest = os.path.dirname(max(moved, key=os.path.getmtime)) if moved else None
    hint = f"; a later run moved the last one to {latest}: move its files back into {output_dir} to continue it"
    return (
        f"RESUME=True but there is no {os.path.join(output_dir, outputs.CHECKPOINT_NAME)}{hint if latest else ''}; "
        f"or run without --resume to start a new run"
    )


def lock_output_dir(output_dir: str, same_run_wait_s: float = 60) -> IO[str]:
    """The OS lock that makes this process the only writer of OUTPUT_DIR (held until the returned file is
    closed or the process ends). Another run's lock is refused in one line; a restart of this same run (same
    torchrun run id or SLURM job) waits for its previous attempt's processes to go."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create OUTPUT_DIR {output_dir} ({e.strerror}); choose another --output_dir") from None
    path, ours = os.path.join(output_dir, LOCK_NAME), next(iter(run_ids().values()), "")
    deadline = time.monotonic() + same_run_wait_s
    while True:
        try:
            handle = outputs.lock_file(path, wait=False)
            break
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # a read-only file system, say
                raise UserError(
                    f"OUTPUT_DIR {output_dir} is not writable ({e.strerror}: {path}); choose another"
                ) from None
        with open(path) as f:
            holder = dict(part.split("=", 1) for part in f.read().split() if "=" in part)
        if not (ours and holder.get("run") == ours and time.monotonic() < deadline):
            raise UserError(
                f"OUTPUT_DIR {output_dir} is in use by another run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it to end or choose another"
            )
        time.sleep(0.5)
    try:
        handle.truncate(0)  # opened to append: the write lands at the new end
        handle.write(
            f"pid={os.getpid()} host={socket.gethostname()} run={ours} since={time.strftime('%Y-%m-%d_%H:%M:%S')}\n"
        )
        handle.flush()
    except OSError as e:  # a full disk: the run could not write its first checkpoint either
        with suppress(OSError):
            handle.close()  # flushes the line again, and fails again: closed all the same
        os.remove(path)  # no other process holds it: ours is the only lock there was
        raise UserError(
            f"cannot write to OUTPUT_DIR {output_dir} ({e.strerror}); free space or choose another"
        ) from None
    return handle
