"""The start rule, and one run per OUTPUT_DIR: `decide` says whether a start is new, a resume (RESUME=True, or a
restart by torchrun or SLURM, which resumes by itself) or finished. precision: PRECISION="auto" made concrete."""

import glob
import importlib
import os
import shutil
import socket
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import filelock
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from distribute_tools import DistInfo, under_torchrun
from safeguards import failures, files, settings
from safeguards.failures import UserError

RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # set by torchrun, and by SLURM on a requeue
_held: list[filelock.BaseFileLock] = []  # rank 0's lock on OUTPUT_DIR, held until the process ends


def decide(cfg: SimpleNamespace, saved: dict[str, Any] | None, restart: str = "") -> tuple[str, Any, list]:
    """'new', 'resume' or 'finished' for the checkpoint a start would continue, the settings it goes on with, lines."""
    if cfg.RESUME and saved is None:
        raise UserError(f"RESUME=True but there is no checkpoint in {cfg.OUTPUT_DIR}; start a new run without it")
    if not (cfg.RESUME or restart) or saved is None:  # a restart before the run's first checkpoint starts it again
        return "new", cfg, []
    cfg, lines = settings.resumed(cfg, saved["config"], "" if cfg.RESUME else restart)
    if int(saved["epoch"]) < cfg.EPOCHS:
        return "resume", cfg, lines
    if os.environ.get("RANK", "0") == "0":  # the launcher, or rank 0: said once
        print(f"already finished: all {cfg.EPOCHS} epochs are in {cfg.OUTPUT_DIR}; nothing to do", flush=True)
    return "finished", cfg, []


def restarted_by() -> str:
    """What says that this start is a restart, e.g. "SLURM_RESTART_COUNT=1"; "" for a first start."""
    return ", ".join(f"{name}={os.environ[name]}" for name in RESTART_COUNTS if os.environ.get(name, "0") != "0")


def lock(output_dir: str, wait_s: float) -> filelock.BaseFileLock:
    """The OS lock making this process OUTPUT_DIR's only writer (made if need be): the kernel frees it at any end."""
    held = filelock.FileLock(os.path.join(output_dir, ".lock"))
    try:
        os.makedirs(output_dir, exist_ok=True)
        held.acquire(timeout=wait_s)
    except filelock.Timeout:
        raise UserError(f"OUTPUT_DIR {output_dir} is in use by another run; wait for it or choose another") from None
    except OSError as e:
        raise UserError(f"OUTPUT_DIR {output_dir} is not writable ({e.strerror}); choose another") from None
    return held


def all_ranks_begin(cfg: SimpleNamespace, info: DistInfo) -> tuple[str, dict[str, Any] | None, SimpleNamespace]:
    """DDP: every rank gets rank 0's decision, checkpoint and settings (begin). A start is a restart if any rank's is
    one: a machine started again joins. A resume goes on from the newest checkpoint in any rank's OUTPUT_DIR (machines
    with disks of their own, and the rendezvous made another one rank 0): its rank hands it over, rank 0 writes on."""
    everyone: list[Any] = [None] * info.world_size
    here = (restarted_by(), files.checkpoint_epoch(cfg.OUTPUT_DIR), f"{socket.gethostname()}:{cfg.OUTPUT_DIR}")
    dist.all_gather_object(everyone, here)  # DDP: what makes each rank's start a restart, and its checkpoint's epoch
    restart = next((said for said, *_ in everyone if said), "")
    holder = max(range(info.world_size), key=lambda rank: (everyone[rank][1], -rank))  # among equals, rank 0
    found: list[Any] = [None]
    where = everyone[holder][2]
    if holder and (cfg.RESUME or restart):  # DDP: the checkpoint (and best.pt) from the rank that holds it, to all
        found = [failures.all_ranks_try(lambda: _read(cfg, restart, with_best=True) if info.rank == holder else None)]
        dist.broadcast_object_list(found, src=holder)
    shared = [failures.all_ranks_try(lambda: begin(cfg, restart, found[0], where, hold=True) if info.is_main else None)]
    dist.broadcast_object_list(shared, src=0)  # DDP: rank 0's decision, checkpoint and settings, to every rank
    return shared[0]


def begin(cfg: SimpleNamespace, restart: str, handed: Any = None, where: str = "", hold: bool = False) -> tuple:
    """The decision on OUTPUT_DIR, which must be writable and no other run's: in the launcher before any rank, and in
    rank 0 for every rank (which `hold`s its lock). A new run moves earlier results aside; a resumed one's lines wait
    for its checks. From now on a failure's line names the epoch whose files are kept."""
    kind, cfg, lines = decide(cfg, saved := handed or _read(cfg, restart), restart)
    if kind == "finished":
        return kind, None, cfg
    held = lock(cfg.OUTPUT_DIR, wait_s=10 if restart else 0)
    _held.append(held) if hold else held.release()
    for name in glob.glob(os.path.join(glob.escape(cfg.OUTPUT_DIR), "*.tmp*")):  # of a run killed in mid-write
        os.remove(name)
    if kind == "new" and (moved := move_aside(cfg.OUTPUT_DIR)):
        print(f"moved the earlier run's results in {cfg.OUTPUT_DIR} to {moved}", flush=True)
    if kind == "resume":  # said, and the CSV rewritten, once its data and network are checked (restore)
        best, path = saved.pop("best.pt", None), os.path.join(cfg.OUTPUT_DIR, files.BEST_NAME)  # the holder's
        files.write_atomically(path, lambda tmp: open(tmp, "wb").write(best)) if best else None  # goes where files go
        came = f" with the checkpoint in {where}, the newest; from now on the files go to {cfg.OUTPUT_DIR}"
        saved["told"] = [f"resuming after epoch {saved['epoch']} of {cfg.EPOCHS}{came * bool(handed)}", *lines]
    failures.tell_kept_files(lambda: kept_files(cfg.OUTPUT_DIR))
    return kind, saved if kind == "resume" else None, cfg


def restore(checkpoint: dict | None, model: nn.Module, optimizer: Any, scaler: Any, identity: str, cfg: Any) -> list:
    """Every rank alike, once the checkpoint's data (`identity`) and network are this run's: weights, optimizer and
    loss scaler; rank 0 says it resumes and rewrites the CSV. The rows of the epochs done ([] for a new run)."""
    history, folder = [], cfg.OUTPUT_DIR
    if dist.get_rank() != 0:  # rank 0 reads its files; the others know the epochs rank 0 took on: `history`'s rows
        done = int(checkpoint["epoch"]) if checkpoint else 0  # (failures.stops_go_on), or the resumed checkpoint's
        failures.tell_kept_files(lambda: kept_files(folder, known=max(len(history), done)))
    if checkpoint is None:  # DDP: with INIT_FROM, a rank that cannot read it stops them all
        return failures.all_ranks_try(lambda: init_from(model, cfg.INIT_FROM) or history) if cfg.INIT_FROM else history
    if checkpoint["data"]["identity"] != identity:
        was = f"the checkpoint in {folder} was trained on other data ({checkpoint['data']['identity']}, now {identity})"
        raise UserError(f"{was}; resume on the same data, or start a new run without --resume")
    if differs := compare_weights(model, checkpoint["model"])[1]:
        was = f"the checkpoint in {folder} is of another network ({differs})"
        raise UserError(f"{was}; resume with the network that wrote it, or start a new run in another --output_dir")
    model.load_state_dict(checkpoint["model"])
    for group, current in zip(checkpoint["optimizer"]["param_groups"], optimizer.param_groups, strict=True):
        group.update(fused=current.get("fused"), foreach=current.get("foreach"), lr=current["lr"])  # this machine's
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"]) if checkpoint.get("scaler") and scaler.is_enabled() else None  # fp16
    history.extend(checkpoint["history"])
    if dist.get_rank() == 0:
        files.write_csv(history, folder)
        ranks, now = checkpoint.get("ranks", dist.get_world_size()), dist.get_world_size()  # the ranks that trained it
        moved = [f"{ranks} ranks trained it, {now} go on: the numbers differ from those of a run that never stopped"]
        print("\n".join(checkpoint["told"] + moved * (ranks != now)), flush=True)
    return history


def compare_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[dict, str]:
    """The tensors of `weights` whose names and shapes the model has, and what differs ('' for the same network)."""
    own = model.state_dict()
    fits = {name: tensor for name, tensor in weights.items() if name in own and own[name].shape == tensor.shape}
    unmatched = [f"{name} {list(own[name].shape)}" for name in own if name not in fits]
    unknown = [f"{name} {list(tensor.shape)}" for name, tensor in weights.items() if name not in fits]
    parts = [(unmatched, f"of make_model's {len(own)} tensors not in it by name and shape"), (unknown, "unknown")]
    return fits, ", ".join(f"{len(names)} {what} (first {names[0]})" for names, what in parts if names)


def read_weights(path: str, named: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The network's tensors of a run's checkpoint.pt (returned whole too), a state_dict or .safetensors file."""
    fix = "give a run's checkpoint.pt or a state_dict file"
    try:
        safetensors = path.endswith(".safetensors") and importlib.import_module("safetensors.torch")  # timm's weights
        saved = safetensors.load_file(path) if safetensors else torch.load(path, map_location="cpu", weights_only=True)
    except ImportError:
        raise UserError(f"{named}{path} is a .safetensors file: pip install safetensors to read it") from None
    except Exception as e:
        raise UserError(f"{named}{path} is no checkpoint torch reads ({failures.first_line(e, 60)}); {fix}") from None
    checkpoint = saved if isinstance(saved, dict) and {"model", "config", "data"} <= saved.keys() else None
    weights = saved.get("model", saved.get("state_dict", saved)) if isinstance(saved, dict) else saved
    if not (isinstance(weights, dict) and weights and all(torch.is_tensor(t) for t in weights.values())):
        keys = f" with keys {', '.join(map(repr, list(weights)[:3]))}" if isinstance(weights, dict) and weights else ""
        raise UserError(f"{named}{path} holds a {type(weights).__name__}{keys}, not a network's tensors; {fix}")
    for prefix in ("module.", "_orig_mod."):  # DDP's, torch.compile's; the metadata too (BatchNorm reads its version)
        consume_prefix_in_state_dict_if_present(weights, prefix)
    return weights, checkpoint


def init_from(model: torch.nn.Module, path: str) -> None:
    """Fine-tuning: the tensors whose names and shapes fit (a new head stays as built); under half of them: refused."""
    weights = read_weights(path, "INIT_FROM ")[0]
    fits, parameters = compare_weights(model, weights)[0], dict(model.named_parameters())
    left = [name for name in parameters if name not in fits]
    loaded, total = (sum(p.numel() for n, p in parameters.items() if n in names) for names in (fits, parameters))
    if loaded < total / 2:
        there = f"{list(weights[left[0]].shape)} in it" if left[0] in weights else "not in it"
        first = f"first mismatch {left[0]}: {there}, {list(parameters[left[0]].shape)} in the network"
        fix = "give a checkpoint of this network (the same layers and widths; the head may differ)"
        raise UserError(f"INIT_FROM {path} fits {loaded:,} of the network's {total:,} parameters ({first}); {fix}")
    model.load_state_dict(fits, strict=False)
    if dist.get_rank() == 0:
        named = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        kept = f"; left as built: {named}" if left else ""
        print(f"fine-tuning from {path}: {loaded:,} of {total:,} parameters loaded{kept}", flush=True)


def move_aside(output_dir: str) -> str | None:
    """A new run never overwrites an earlier one: its files (TensorBoard's too) move to OUTPUT_DIR/previous-<time>/."""
    names = os.listdir(output_dir)  # the CSV first: its time names the folder
    found = [name for name in files.RESULT_FILES if name in names]
    found += sorted(name for name in names if name.startswith(files.EVENTS_PREFIX))
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(output_dir, found[0]))))
    destination = tempfile.mkdtemp(prefix=f"previous-{stamp}-", dir=output_dir)  # a new name, even at the same time
    for name in found:
        shutil.move(os.path.join(output_dir, name), os.path.join(destination, name))
    return destination


def kept_files(output_dir: str, known: int | None = None) -> str:
    """What a stopped or failed run leaves to continue from, once its files are finished. `known`: a rank other than 0
    names the last epoch whose files every rank knows written, on rank 0's machine (0: none known there yet)."""
    epoch = files.checkpoint_epoch(output_dir) if known is None else known
    if not epoch and known is None:
        return failures.NOTHING_KEPT
    where = f"in {output_dir}" + (" on the node of global rank 0" if known is not None else "")
    kept = f"the files {where} are from epoch {epoch}" if epoch else f"the files are {where} (no epoch known here)"
    if under_torchrun() and not os.environ.get(failures.LAUNCHER_PID):
        how = "continue with the same command on every node and --resume True (torchrun's restarts and a SLURM requeue"
        return f"{kept}; {how} do so by themselves)"
    return f"{kept}: continue with --resume True"


def _read(cfg: SimpleNamespace, restart: str, with_best: bool = False) -> dict[str, Any] | None:
    """The checkpoint in OUTPUT_DIR (None: there is none), `with_best` with best.pt's bytes. An unreadable one is one
    line where the start would continue it (a resume or restart never starts over in silence), else left alone."""
    path, best = (os.path.join(cfg.OUTPUT_DIR, name) for name in (files.CHECKPOINT_NAME, files.BEST_NAME))
    try:
        saved = files.load_checkpoint(cfg.OUTPUT_DIR) if os.path.exists(path) else None
        return saved | {"best.pt": open(best, "rb").read()} if saved and with_best and os.path.exists(best) else saved
    except Exception as e:
        if not (cfg.RESUME or restart):
            return None
        raise UserError(f"cannot read {path} ({failures.first_line(e, 80)}); put back a good copy or move it") from None


def precision(device: torch.device, wanted: str, model: nn.Module, image_size: int) -> str:
    """PRECISION in the first line's words (the first: bf16, fp16 or fp32). auto: bf16 where it is fast (GPUs from
    Ampere on, CPUs with native bf16), fp16 on older GPUs (T4, V100: fp16 tensor cores), else fp32 (cpu_bf16_faults)."""
    cpu = open("/proc/cpuinfo").read() if device.type == "cpu" and os.path.exists("/proc/cpuinfo") else ""  # (Linux)
    if wanted == "auto":
        fast = torch.cuda.get_device_capability(device) >= (8, 0) if device.type == "cuda" else "avx512_bf16" in cpu
        wanted = "bf16" if fast else "fp16" if device.type == "cuda" else "fp32"
    if faults := cpu_bf16_faults(model, image_size) if wanted == "bf16" and device.type == "cpu" else []:
        return f"fp32 (oneDNN's bf16 is wrong for {faults[0]} on CPUs: docs/cpu-kinds.md)"
    return {"bf16": "bf16 autocast", "fp16": "fp16 autocast, dynamic loss scaling", "fp32": "fp32"}[wanted]


@torch.no_grad()
def cpu_bf16_faults(model: nn.Module, image_size: int) -> list[str]:
    """The strided convolutions with a 1x1 output at this size (mobilenet_v3_small's at 16x16), found by one blank
    forward pass: oneDNN's bf16 weight gradient of those holds memory it never wrote (docs/cpu-kinds.md)."""
    ones: set[nn.Module] = set()  # the modules with a 1x1 output (the hook returns None: the output stays)
    with register_module_forward_hook(lambda m, _, out: ones.update([m] * (getattr(out, "shape", ())[-2:] == (1, 1)))):
        model.eval()(torch.zeros(2, 3, image_size, image_size))
    model.train()
    strided = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d) and max(m.stride) > 1]
    return [name for name, m in strided if m in ones]
