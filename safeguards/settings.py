"""The training script's annotated UPPER_CASE constants as its command line: --name value or --name=value, --help
with type, default and comment; a bad value (type or range) and each check that needs no rank fail in one line."""

import argparse
import importlib.util
import math
import os
import re
import typing
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import Any

import distribute_tools
from safeguards.failures import UserError

# The settings a resumed run may change: those below this comment in the block (a resume keeps the others' values).
FREE_FROM = "a resumed run may change these"
FREE_ON_RESUME: set[str] = set()  # filled in by read()
# Allowed ranges: (lowest, highest), None where open; one the script lacks (WIDTH, after a network swap) is skipped.
LIMITS = {name: (1, None) for name in "EPOCHS BATCH_SIZE ACCUMULATE SYNTHETIC_SIZE COLLECTIVE_TIMEOUT".split()}
LIMITS |= {"WIDTH": (1, None), "EVAL_EVERY": (1, None), "IMAGE_SIZE": (8, None), "NUM_WORKERS": (-1, None)}
LIMITS |= {"WARMUP": (0, 1), "LABEL_SMOOTHING": (0, 0.99), "HOLDOUT": (0, 0.5)}
LIMITS |= {"MOMENTUM": (0, 0.999), "WEIGHT_DECAY": (0, 1), "LR": (1e-12, None), "WORLD_SIZE": (0, None)}
BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
KINDS = {int: "an integer, e.g. 1", float: "a number, e.g. 0.1", bool: "True or False", str: "text"}
DEFAULTS: dict[str, Any] = {}  # each setting's value in the file, as read() found it
GIVEN: list[str] = []  # the settings that the command line gave, as the last read() found them


def read(script: ModuleType, argv: list[str]) -> SimpleNamespace:
    """The settings of `script` with the command line's overrides applied, each checked."""
    with open(script.__file__, encoding="utf-8") as f:  # each setting's --help is the comment on its line
        text = f.read()
    comments = dict(re.findall(r"^([A-Z][A-Z0-9_]*): .*?  # (.*)$", text, re.MULTILINE))
    FREE_ON_RESUME.update(re.findall(r"^([A-Z][A-Z0-9_]*):", text[text.find(FREE_FROM) :], re.MULTILINE))
    parser = _OneLineParser(description=(script.__doc__ or "").split("\n")[0], allow_abbrev=False)
    for name, kind in ((n, k) for n, k in script.__annotations__.items() if n.isupper()):
        default, choices = getattr(script, name), typing.get_args(kind) or None
        kind = type(choices[0]) if choices else kind
        if type(default) not in (kind, int if kind is float else kind) or default not in (choices or [default]):
            expected = "one of " + ", ".join(map(str, choices)) if choices else KINDS[kind]
            raise UserError(f"{name} = {default!r} at the top of {script.__file__} is not {expected}")
        DEFAULTS[name] = default
        help_text = f"{comments.get(name, '')} (default: {default})".replace("%", "%%")
        bare = {"nargs": "?", "const": True} if kind is bool else {}  # a bare --resume means True
        option = {"type": partial(_convert, name, kind), "default": default, "choices": choices, "help": help_text}
        option["metavar"] = None if choices else kind.__name__.upper()  # --help: the type, or the choices
        parser.add_argument(f"--{name.lower()}", dest=name, **option, **bare)
    cfg = SimpleNamespace(**vars(parser.parse_args(argv)))
    GIVEN[:] = [name for name in DEFAULTS if any(a.partition("=")[0] == f"--{name.lower()}" for a in argv)]
    for name, (low, high) in LIMITS.items():
        value = getattr(cfg, name, None)
        if value is not None and not (low <= value and (high is None or value <= high)):
            where = "at the top of train_distribute.py" if value == DEFAULTS[name] else "on the command line"
            allowed = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise UserError(f"{name}={value!r} {where} is out of range: it must be {allowed}")
    return cfg


def check(cfg: SimpleNamespace, resuming: bool = False) -> SimpleNamespace:
    """The checks that need no rank; a resume's settings pass them again (`resuming`: the checkpoint's BATCH_SIZE,
    checked then, not the block's, under RESUME=True). Returns `cfg`."""
    world_size = distribute_tools.world_size(cfg.WORLD_SIZE)
    if cfg.BATCH_SIZE % (world_size * cfg.ACCUMULATE) and (resuming or not cfg.RESUME):
        split = f"{world_size} ranks x {cfg.ACCUMULATE} micro-batches" if cfg.ACCUMULATE > 1 else f"{world_size} ranks"
        fix = "resume with a --world_size or --accumulate that splits it" if resuming else "use a multiple"
        whose = ", the checkpoint's," if resuming else ""  # a resume's refusal: the value it goes on with
        raise UserError(f"BATCH_SIZE={cfg.BATCH_SIZE}{whose} does not split evenly over {split}; {fix}")
    for name in ("DATA_DIR", "OUTPUT_DIR"):
        if os.path.isfile(getattr(cfg, name)):
            raise UserError(f"{name} {getattr(cfg, name)} is a file, not a folder; give a folder")
    if cfg.DATASET == "cifar10" and cfg.IMAGE_SIZE != 32:
        raise UserError(f"IMAGE_SIZE={cfg.IMAGE_SIZE} but CIFAR-10's images are 32x32; use --image_size 32")
    if cfg.TENSORBOARD and importlib.util.find_spec("tensorboard") is None:
        raise UserError("TENSORBOARD=True needs the tensorboard package: pip install tensorboard, or leave it False")
    if cfg.INIT_FROM and not (cfg.RESUME or resuming) and not os.path.isfile(cfg.INIT_FROM):  # a resume has weights
        raise UserError(f"INIT_FROM {cfg.INIT_FROM} is no file; give a run's checkpoint.pt or a state_dict file")
    return cfg


def resumed(cfg: SimpleNamespace, saved: dict[str, Any], restart: str = "") -> tuple[SimpleNamespace, list[str]]:
    """The settings a resume goes on with, and its lines on them: the checkpoint's (its default for a setting added
    since), but where the command line gives one a resume may change (FREE_ON_RESUME; EPOCHS upwards on --resume,
    extending the run); another change is refused in one line. `restart`: what makes this start a restart."""
    merged, taken = {}, []
    for name, value in vars(cfg).items():
        was = saved.get(name, DEFAULTS.get(name, value))
        if name not in GIVEN and name not in ("OUTPUT_DIR", "RESUME"):  # where it is, and that it resumes: now's
            merged[name] = was
            taken += [f"{name}={was!r}"] if was != value else []
            continue
        extended = name == "EPOCHS" and value > was and not restart
        if value != was and name not in FREE_ON_RESUME and not extended:
            who = f"this start is a restart ({restart})" if restart else "RESUME=True"
            fix = f"set {name} back to {was!r}" if restart else f"resume without --{name.lower()}"
            differs = f"{name}={value!r} differs from the checkpoint's {was!r} in {cfg.OUTPUT_DIR}"
            raise UserError(f"{who}: {differs}; {fix}, or start a new run in another --output_dir")
        merged[name] = value
    lines = [f"the checkpoint's settings, not the block's: {', '.join(taken)}"] if taken else []
    if (epochs := merged["EPOCHS"]) > saved["EPOCHS"]:
        longer = f"extended from {saved['EPOCHS']} to {epochs} epochs: the schedule is recomputed over {epochs}"
        lines.append(f"{longer}, so the numbers differ from those of a run started with --epochs {epochs}")
    return check(SimpleNamespace(**merged), resuming=True), lines


def _convert(name: str, kind: type, text: str) -> Any:
    try:
        value = BOOLEANS[text.lower()] if kind is bool else kind(text)
        if kind is float and not math.isfinite(value):
            raise ValueError
        return value
    except (KeyError, ValueError):
        raise UserError(f"--{name.lower()}={text} is not {KINDS[kind]}") from None


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming the fix instead of usage text."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments: --"):
            message = f"unknown setting {message.split()[2].partition('=')[0]}"
        raise UserError(f"{message}; write settings as --name value or --name=value (--help lists them)")
