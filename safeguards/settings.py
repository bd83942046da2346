"""The constants at the top of the training script as its command line: `--name value` or `--name=value` for each
UPPER_CASE constant with a type annotation, `--help` with its type, default, choices and the comment on its line,
and one line for a value of the wrong type or out of range (in the file or on the command line)."""

import argparse
import difflib
import io
import math
import tokenize
import typing
from types import ModuleType, SimpleNamespace
from typing import Any

from safeguards.failures import UserError

# Settings that may differ between a run and its resumption: where files are, how it is launched and on what
# hardware, how it evaluates or reports. Every other setting shapes the run, so a new one is checked on resume.
FREE_ON_RESUME = set(
    "DATA_DIR OUTPUT_DIR RESUME WORLD_SIZE AMP COMPILE SYNC_BN ACCUMULATE BF16_ALLREDUCE TTA COLLECTIVE_TIMEOUT "
    "LOADER NUM_WORKERS".split()
)
# Allowed ranges (lowest, highest), None where open.
LIMITS = {
    "EPOCHS": (1, None),
    "BATCH_SIZE": (1, None),
    "IMAGE_SIZE": (8, None),
    "SYNTHETIC_SIZE": (1, None),
    "NUM_WORKERS": (-1, None),
    "ACCUMULATE": (1, None),
    "COLLECTIVE_TIMEOUT": (1, None),
    "WARMUP": (0, 1),
    "LABEL_SMOOTHING": (0, 0.99),
    "MOMENTUM": (0, 0.999),
    "WEIGHT_DECAY": (0, 1),
    "LR": (1e-12, None),
}
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
DEFAULTS: dict[str, Any] = {}  # each setting's value in the file, as read() found it


def read(script: ModuleType, argv: list[str]) -> SimpleNamespace:
    """The settings of `script` with the command line's overrides applied, each checked."""
    settings = {name: kind for name, kind in script.__annotations__.items() if name.isupper()}
    comments = _comments(script.__file__)
    parser = _OneLineParser(prog="train_distribute.py", description=(script.__doc__ or "").split("\n")[0])
    for name, kind in settings.items():
        default, choices = getattr(script, name), typing.get_args(kind) or None
        base = type(choices[0]) if choices else kind
        if (
            not isinstance(default, base)
            or (base is not bool and isinstance(default, bool))
            or default not in (choices or [default])
        ):
            raise UserError(f"{name} = {default!r} at the top of {script.__file__} is not {_kind(base, choices)}")
        parser.add_argument(
            f"--{name.lower()}",
            dest=name,
            type=_converter(name, base),
            default=default,
            choices=choices,
            metavar="{" + ",".join(choices) + "}" if choices else base.__name__.upper(),
            help=f"{comments.get(name, '')} (default: {default})".replace("%", "%%"),
            **({"nargs": "?", "const": True} if base is bool else {}),
        )
        DEFAULTS[name] = default
    cfg = SimpleNamespace(**vars(parser.parse_args(argv)))
    for name, (low, high) in LIMITS.items():
        value = getattr(cfg, name, None)
        if value is not None and (low is not None and value < low or high is not None and value > high):
            where = "at the top of train_distribute.py" if value == getattr(script, name) else "on the command line"
            allowed = (
                f"from {low} to {high}" if high is not None else "positive" if low in (1, 1e-12) else f"at least {low}"
            )
            raise UserError(f"{name}={value!r} {where} is out of range: it must be {allowed}")
    return cfg


def check_resume(saved: dict[str, Any], cfg: SimpleNamespace, restart: str = "") -> None:
    """A resumed run continues the same run: every setting outside FREE_ON_RESUME as the checkpoint's (one added
    since it was written counts as its default there). `restart`: what made this start a restart (torchrun's or
    SLURM's count), which resumes by itself: its fix is another, not --resume."""
    for name, value in vars(cfg).items():
        was = saved.get(name, DEFAULTS.get(name, value))
        if name in FREE_ON_RESUME or was == value:
            continue
        if restart:
            raise UserError(
                f"this start is a restart ({restart}) of the run in {cfg.OUTPUT_DIR}, whose checkpoint has {name}="
                f"{was!r} where the settings now say {value!r}; set {name} back to {was!r} to continue it, or end the "
                f"job and start a new run in another --output_dir"
            )
        raise UserError(
            f"RESUME=True but {name}={value!r} differs from the checkpoint's {was!r}; resume with --{name.lower()} "
            f"{was}, or start a new run"
        )


def _converter(name: str, kind: type) -> Any:
    def convert(text: str) -> Any:
        if kind is bool and text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        try:
            value = kind(text) if kind is not bool else None
        except ValueError:
            value = None
        if value is None or (kind is float and not math.isfinite(value)):
            raise UserError(
                f"--{name.lower()}={text} is not {_kind(kind, None)}; e.g. --{name.lower()} {_EXAMPLE[kind]}"
            )
        return value

    return convert


_EXAMPLE = {int: "1", float: "0.1", bool: "True", str: "text"}


def _kind(kind: type, choices: tuple | None) -> str:
    if choices:
        return "one of " + ", ".join(map(str, choices))
    return {int: "an integer", float: "a number", bool: "True or False", str: "text"}[kind]


def _comments(path: str) -> dict[str, str]:
    """The comment at the end of each `NAME: type = value  # comment` line: the setting's --help text."""
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(io.StringIO(f.read()).readline))
    found = {}
    for token in tokens:
        if token.type == tokenize.COMMENT and token.line[:1].isupper() and ":" in token.line:
            found[token.line.split(":")[0].strip()] = token.string.lstrip("# ").strip()
    return found


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming the fix instead of usage text."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments: --"):
            name = message.split()[2][2:].partition("=")[0]
            close = difflib.get_close_matches(name.lower(), [a.dest.lower() for a in self._actions], n=1)
            message = f"unknown setting --{name}" + (f"; did you mean --{close[0]}?" if close else "")
        raise UserError(f"{message}; write settings as --name value or --name=value (--help lists them)")
