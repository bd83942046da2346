"""The start rule, and one run per OUTPUT_DIR. `decide` says whether a start is new, a resume (RESUME=True, or a
restart by torchrun or SLURM, which resumes by itself) or finished: the launcher asks it before any rank starts, and
the ranks ask it again on the newest checkpoint of any machine (each machine's OUTPUT_DIR may be its own disk)."""

import glob
import os
import shutil
import time
from types import SimpleNamespace
from typing import Any

import filelock
import torch
import torch.distributed as dist

from distribute_tools import DistInfo, under_torchrun
from safeguards import failures, files, settings
from safeguards.failures import UserError

RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # set by torchrun, and by SLURM on a requeue
_held: list[filelock.BaseFileLock] = []  # rank 0's lock on OUTPUT_DIR, held until the process ends


def decide(cfg: SimpleNamespace, saved: dict[str, Any] | None, restart: str | None = None) -> str:
    """'new', 'resume' or 'finished', from the settings and the checkpoint a start would continue (None: none), and
    what makes the start a restart (`restart`; by default this process's restart counts)."""
    restart = restarted_by() if restart is None else restart
    if not (cfg.RESUME or restart):
        return "new"
    if saved is None or not (cfg.RESUME or _same_run(saved.get("run_ids", {}))):
        if cfg.RESUME:
            raise UserError(_no_checkpoint(cfg.OUTPUT_DIR))
        return "new"  # a restart before the run's first checkpoint starts it again
    settings.check_resume(saved["config"], cfg, "" if cfg.RESUME else restart)
    if int(saved["epoch"]) < cfg.EPOCHS:
        return "resume"
    if os.environ.get("RANK", "0") == "0":  # the launcher, or rank 0: said once
        print(f"already finished: all {cfg.EPOCHS} epochs are in {cfg.OUTPUT_DIR}; nothing to do", flush=True)
    return "finished"


def restarted_by() -> str:
    """What says that this start is a restart, e.g. "SLURM_RESTART_COUNT=1"; "" for a first start."""
    return ", ".join(f"{name}={os.environ[name]}" for name in RESTART_COUNTS if os.environ.get(name, "0") != "0")


def run_ids() -> dict[str, str]:
    """Every name of this run that survives a restart: a restart continues its own run's checkpoint and no other."""
    names = {"torchrun": "TORCHELASTIC_RUN_ID", "slurm": "SLURM_JOB_ID"}
    return {kind: os.environ[name] for kind, name in names.items() if os.environ.get(name)}


def _same_run(saved_by: dict[str, str]) -> bool:
    return not run_ids() or any(saved_by.get(kind) == name for kind, name in run_ids().items())


def decide_here(cfg: SimpleNamespace) -> str:
    """In the launcher, before any rank: the decision on OUTPUT_DIR, which must be writable and no other run's. From
    now on a failure's line names the epoch whose files are kept."""
    try:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create OUTPUT_DIR {cfg.OUTPUT_DIR} ({e.strerror}); choose another") from None
    lock(cfg.OUTPUT_DIR, wait_s=0).release()
    kind = decide(cfg, _read(cfg))
    earlier = _stamp(cfg.OUTPUT_DIR)  # a checkpoint this run has not replaced is an earlier run's
    failures.tell_kept_files(lambda: kept_files(cfg.OUTPUT_DIR, kind != "new" or _stamp(cfg.OUTPUT_DIR) != earlier))
    return kind


def lock(output_dir: str, wait_s: float) -> filelock.BaseFileLock:
    """The OS lock that makes this process the only writer of OUTPUT_DIR; the kernel releases it however the process
    ends. A restart waits a little for its previous attempt's processes to go."""
    held = filelock.FileLock(os.path.join(output_dir, ".lock"))
    try:
        held.acquire(timeout=wait_s)
    except filelock.Timeout:
        raise UserError(
            f"OUTPUT_DIR {output_dir} is in use by another run; wait for it to end or choose another"
        ) from None
    except OSError as e:
        raise UserError(f"OUTPUT_DIR {output_dir} is not writable ({e.strerror}); choose another") from None
    return held


def all_ranks_begin(cfg: SimpleNamespace, info: DistInfo) -> tuple[str, dict[str, Any] | None]:
    """DDP: every rank. The decision on the newest checkpoint of any machine, and that checkpoint, sent to every rank
    from where it lies; rank 0 locks OUTPUT_DIR and makes it this run's."""
    here = failures.all_ranks_try(lambda: _read(cfg) if info.local_rank == 0 else None)
    everyone: list[Any] = [None] * info.world_size
    mine = (int(here["epoch"]), here.get("run_ids", {})) if here else (-1, {})
    dist.all_gather_object(everyone, (*mine, restarted_by()))
    epochs = [epoch if cfg.RESUME or _same_run(ids) else -1 for epoch, ids, _ in everyone]
    restart = next((said for *_, said in everyone if said), "")  # a machine started again joins a restarted run
    source, shared = epochs.index(max(epochs)), [here]
    if max(epochs) >= 0 and (cfg.RESUME or restart):
        dist.broadcast_object_list(shared, src=source)  # DDP: the newest checkpoint, from the rank that read it
    kind = decide(cfg, shared[0] if max(epochs) >= 0 else None, restart)  # every rank alike, on the same checkpoint
    checkpoint = shared[0] if kind == "resume" else None
    if kind != "finished":
        failures.all_ranks_try(lambda: _make_ours(cfg, checkpoint, source) if info.is_main else None)
    return kind, checkpoint


def _make_ours(cfg: SimpleNamespace, checkpoint: dict[str, Any] | None, source: int) -> None:
    """Rank 0: a new run moves earlier results aside; a resumed one rewrites the CSV from its checkpoint (rows written
    after it belong to an epoch that runs again) and keeps a checkpoint from another machine here."""
    os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
    _held.append(lock(cfg.OUTPUT_DIR, wait_s=10 if restarted_by() else 0))
    for name in glob.glob(os.path.join(glob.escape(cfg.OUTPUT_DIR), "*.tmp*")):  # of a run killed in mid-write
        os.remove(name)
    if (checkpoint is None or source != 0) and (moved := move_aside(cfg.OUTPUT_DIR)):
        print(f"moved the {'older' if checkpoint else 'earlier run'}'s results in {cfg.OUTPUT_DIR} to {moved}")
    if checkpoint is not None:
        if source != 0:
            files.write_atomically(f"{cfg.OUTPUT_DIR}/{files.CHECKPOINT_NAME}", lambda tmp: torch.save(checkpoint, tmp))
        files.write_csv(checkpoint["history"], cfg.OUTPUT_DIR)
        where = f" (the checkpoint of rank {source}'s machine)" if source else ""
        print(f"resuming after epoch {checkpoint['epoch']} of {cfg.EPOCHS}{where}", flush=True)
    failures.tell_kept_files(lambda: kept_files(cfg.OUTPUT_DIR))


def restore(checkpoint: dict | None, model: torch.nn.Module, optimizer: Any, identity: str, folder: str) -> list[dict]:
    """Every rank alike, before anything changes: the checkpoint's data (`identity`) and network are this run's.
    Loads the weights and the optimizer's state; returns the rows of the epochs done ([] for a new run), the list that
    the epoch loop goes on appending to."""
    history: list[dict] = []
    if dist.get_rank() != 0:  # rank 0 reads its files; the others know what every rank saw written: the rows before
        done = int(checkpoint["epoch"]) if checkpoint else 0  # the last (its files are being written), or the resumed
        failures.tell_kept_files(lambda: kept_files(folder, known=max(len(history) - 1, done)))
    if checkpoint is None:
        return history
    if checkpoint["data"]["identity"] != identity:
        raise UserError(
            f"the checkpoint in {folder} was trained on other data ({checkpoint['data']['identity']}, now "
            f"{identity}); resume on the same data, or start a new run without --resume"
        )
    saved, mine = checkpoint["model"], model.state_dict()
    for name in saved.keys() | mine.keys():
        shapes = [tuple(weights[name].shape) if name in weights else "none" for weights in (saved, mine)]
        if shapes[0] != shapes[1]:
            raise UserError(
                f"the checkpoint in {folder} is of another network: its {name} is {shapes[0]}, this network's "
                f"{shapes[1]}; resume with the network that wrote it, or start a new run in another --output_dir"
            )
    model.load_state_dict(saved)
    for group, current in zip(checkpoint["optimizer"]["param_groups"], optimizer.param_groups, strict=True):
        group.update(fused=current.get("fused"), foreach=current.get("foreach"))  # this machine's kernels
    optimizer.load_state_dict(checkpoint["optimizer"])
    history.extend(checkpoint["history"])
    return history


def move_aside(output_dir: str) -> str | None:
    """A new run never overwrites an earlier one: its files move to OUTPUT_DIR/previous-<time>/."""
    found = [name for name in files.RESULT_FILES if os.path.exists(os.path.join(output_dir, name))]
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


def kept_files(output_dir: str, ours: bool = True, known: int | None = None) -> str:
    """What a stopped or failed run leaves to continue from, once its files are finished. `ours`: the checkpoint
    there is this run's (not an earlier run's that a new run had yet to move aside). `known`: a rank other than 0
    names the last epoch whose files every rank knows written, on rank 0's machine."""
    epoch = known if known is not None else files.checkpoint_epoch(output_dir) if ours else 0
    if not epoch:
        return (
            failures.NOTHING_KEPT if known is None else "no epoch's files were known written: see global rank 0's line"
        )
    where = f"in {output_dir}" + (" on the node of global rank 0" if known is not None else "")
    if under_torchrun() and not os.environ.get(failures.LAUNCHER_PID):
        how = "continue with the same command on every node and --resume True (torchrun's restarts and a SLURM requeue"
        return f"the files {where} are from epoch {epoch}; {how} do so by themselves)"
    return f"the files {where} are from epoch {epoch}: continue with --resume True"


def _read(cfg: SimpleNamespace) -> dict[str, Any] | None:
    """The checkpoint in OUTPUT_DIR (None: there is none). An unreadable one is one line where the start would continue
    it (a resume or restart never starts over in silence), and left alone otherwise (a new run moves it aside)."""
    path = os.path.join(cfg.OUTPUT_DIR, files.CHECKPOINT_NAME)
    try:
        return files.load_checkpoint(cfg.OUTPUT_DIR) if os.path.exists(path) else None
    except Exception as e:
        if not (cfg.RESUME or restarted_by()):
            return None
        raise UserError(
            f"cannot read {path} ({type(e).__name__}: {failures.first_line(e, 80)}); it stays as it is: put back a "
            f"good copy to continue, or move it away to start the run over"
        ) from None


def _stamp(output_dir: str) -> tuple[int, int] | None:
    """Which file the checkpoint is: every write replaces it with a new one."""
    path = os.path.join(output_dir, files.CHECKPOINT_NAME)
    return (os.stat(path).st_ino, os.stat(path).st_mtime_ns) if os.path.exists(path) else None


def _no_checkpoint(output_dir: str) -> str:
    """RESUME=True found nothing to resume: say where a later run moved the last checkpoint, if it did."""
    moved = glob.glob(os.path.join(glob.escape(output_dir), "previous-*", files.CHECKPOINT_NAME))
    latest = os.path.dirname(max(moved, key=os.path.getmtime)) if moved else ""
    hint = f"; a later run moved the last one to {latest}: move its files back to continue it" if moved else ""
    return f"RESUME=True but there is no {os.path.join(output_dir, files.CHECKPOINT_NAME)}{hint}; or start a new run"
