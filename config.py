"""The settings of a run: read from the block at the top of train_distribute.py, overridden on the command line.

The block is the one place where a setting is written. Each line there has the form

    NAME: type = value  # what it does

with type int, float, bool, str or Literal["a", "b"] (a choice). This module reads the block from the
script's source (names, types, values and comments, in order; comment lines above a group of settings
become its heading) and derives from it:
    the command line     `--name value` or `--name=value`, `--help` listing every setting
    the checks           a value of the wrong type or out of range, in the file or on the command line, is one line
    the resume rule      a resumed run must share every setting except those in FREE_ON_RESUME
"""

import argparse
import ast
import difflib
import io
import math
import tokenize
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from processes import UserError

# Settings that may differ between a run and its resumption: where files are, how the run is launched and on
# what hardware, how it evaluates or reports. Every other setting shapes the run, so a new setting is checked
# on resume unless it is added here.
FREE_ON_RESUME = tuple(
    "DATA_DIR OUTPUT_DIR RESUME WORLD_SIZE AMP COMPILE SYNC_BN ACCUMULATE BF16_ALLREDUCE TTA COLLECTIVE_TIMEOUT "
    "PROGRESS_EVERY LOADER NUM_WORKERS".split()
)
# Allowed ranges, (lowest, highest) with None where open; text settings must not be empty.
LIMITS = {
    "EPOCHS": (1, None),
    "BATCH_SIZE": (1, None),
    "IMAGE_SIZE": (8, None),
    "SYNTHETIC_SIZE": (1, None),
    "NUM_WORKERS": (-1, None),
    "ACCUMULATE": (1, None),
    "COLLECTIVE_TIMEOUT": (1, None),
    "PROGRESS_EVERY": (1, None),
    "WARMUP": (0, 1),
    "LABEL_SMOOTHING": (0, 0.99),
    "MOMENTUM": (0, 0.999),
    "WEIGHT_DECAY": (0, 1),
}
DESCRIPTION = (
    "Train a ResNet with DistributedDataParallel. Every setting is a constant at the top of train_distribute.py; "
    "--name value overrides it for one run. Under torchrun: torchrun [its options] train_distribute.py [settings]."
)
DEFAULTS: dict[str, Any] = {}  # every setting's value in the block, as read_config last found it
KIND_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "text"}
METAVARS = {int: "N", float: "X", bool: "BOOL", str: "TEXT"}  # --help's placeholder for a value
TRUE, FALSE = ("true", "1"), ("false", "0")


@dataclass(frozen=True)
class Setting:
    name: str  # as in the file: EPOCHS
    kind: type  # int, float, bool or str
    default: Any  # the value in the file
    help: str  # the comment on its line
    choices: tuple[str, ...] = ()  # for Literal["a", "b"]
    group: tuple[str, str] = ("settings", "")  # (title, description): the comment lines above its group

    @property
    def option(self) -> str:
        return f"--{self.name.lower()}"


def read_config(script: str, argv: list[str]) -> SimpleNamespace:
    """The settings of `script` with the command line's overrides applied, each checked: one line per mistake."""
    settings = read_settings(script)
    DEFAULTS.update({s.name: s.default for s in settings})
    values, unknown = _parser(settings).parse_known_args(argv)
    if unknown:
        raise UserError(_unknown_argument(unknown[0], settings))
    for s in settings:
        value = getattr(values, s.name)
        if isinstance(value, str) and s.kind is not str:
            value = _parse(s, value)
        _check_type(s, value, where=f"{s.option}={value}")
        setattr(values, s.name, value)
    cfg = SimpleNamespace(**vars(values))
    _check_limits(cfg, settings)
    return cfg


# ----------------------------------------------------------------------------- the block in the source


def read_settings(script: str) -> list[Setting]:
    """Every `NAME: type = value  # comment` line at the top level of `script`, in order."""
    with open(script, encoding="utf-8") as f:
        source = f.read()
    comments, lines, body = _comments_by_line(source), source.splitlines(), ast.parse(source).body
    annotated = [
        n for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id.isupper()
    ]
    settings: list[Setting] = []
    for node in body:
        if node in annotated:
            setting = _setting(node, comments, lines, settings[-1].group if settings else ("settings", ""))  # type: ignore[arg-type]
            if any(s.name == setting.name for s in settings):
                raise UserError(
                    f"{setting.name} is written twice in the settings block of {script} (line "
                    f"{node.lineno} and an earlier one); keep one"
                )
            settings.append(setting)
        elif annotated and annotated[0].lineno < node.lineno < annotated[-1].lineno and isinstance(node, ast.Assign):
            name = getattr(node.targets[0], "id", "")  # a setting written without its type, say `EPOCHS = 5`
            if name.isupper():
                raise UserError(
                    f"{name} at line {node.lineno} of {script} has lost its type; write it as {name}: int = ... "
                    f"(or float, bool, str) like the settings around it"
                )
    return settings


def _setting(node: ast.AnnAssign, comments: dict[int, str], lines: list[str], group: tuple[str, str]) -> Setting:
    name = node.target.id  # type: ignore[attr-defined]
    kind, choices = _kind(node.annotation, name)
    try:
        default = ast.literal_eval(node.value) if node.value is not None else None
    except ValueError:
        raise UserError(
            f"{name} at line {node.lineno} of train_distribute.py must be a plain value (a number, True/False or "
            f"text in quotes)"
        ) from None
    heading, line = [], node.lineno - 1  # lines are 1-based: lines[line - 1] is the one above
    while line >= 1 and lines[line - 1].lstrip().startswith("#"):
        text = lines[line - 1].strip().lstrip("#").strip()
        if not text.startswith("---"):  # a banner line above the block is not a heading
            heading.insert(0, text)
        line -= 1
    if heading:
        group = (heading[0], " ".join(heading[1:]))
    setting = Setting(name, kind, default, comments.get(node.lineno, ""), choices, group)
    _check_type(setting, default, where=f"{name} = {default!r} at the top of train_distribute.py")
    return setting


def _kind(annotation: ast.expr, name: str) -> tuple[type, tuple[str, ...]]:
    if isinstance(annotation, ast.Name) and annotation.id in ("int", "float", "bool", "str"):
        return {"int": int, "float": float, "bool": bool, "str": str}[annotation.id], ()
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Literal":
        choices = ast.literal_eval(annotation.slice)
        return str, tuple(choices) if isinstance(choices, tuple) else (choices,)
    raise UserError(f"{name} has type {ast.unparse(annotation)}; settings are int, float, bool, str or Literal[...]")


def _comments_by_line(source: str) -> dict[int, str]:
    """The comment at the end of each line that has code before it."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.line.strip() != token.string.strip():
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


# ----------------------------------------------------------------------------- types, values, ranges


def _check_type(setting: Setting, value: Any, where: str) -> None:
    kind = setting.kind  # an int is a float too; True is no number
    fits = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
    if not fits:
        example = repr(setting.default) if isinstance(setting.default, kind) else _EXAMPLES[kind]
        raise UserError(f"{where} is not {KIND_NAMES[kind]}; write e.g. {setting.name}: {kind.__name__} = {example}")
    if setting.choices and value not in setting.choices:
        raise UserError(f"{setting.name}={value!r} is unknown; use one of {', '.join(setting.choices)}")


_EXAMPLES = {int: "1", float: "0.1", bool: "True", str: '"text"'}


def _parse(setting: Setting, text: str) -> Any:
    """A command-line value of `setting`, converted to its type."""
    try:
        if setting.kind is bool:
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            return text.lower() in TRUE
        value = setting.kind(text)
        if setting.kind is float and not math.isfinite(value):
            raise ValueError
        return value
    except ValueError:
        raise UserError(
            f"{setting.option}={text} is not {KIND_NAMES[setting.kind]}; e.g. {setting.option}={setting.default}"
        ) from None


def _check_limits(cfg: SimpleNamespace, settings: list[Setting]) -> None:
    """Every value inside its allowed range: one line naming the setting and a good value. A bad value written
    in the file itself is named as such, with an example that is inside the range."""
    for s in settings:
        value, (low, high) = getattr(cfg, s.name), LIMITS.get(s.name, (None, None))
        if s.kind is str and not value.strip() and not s.choices:
            problem, good = "is empty", repr(s.default) if s.default.strip() else '"./output"'
        elif s.name == "LR" and not value > 0:
            problem, good = "must be a positive number", s.default if s.default > 0 else 0.1
        elif low is not None and value < low or high is not None and value > high:
            problem = f"is outside {low}..{high}" if high is not None else f"must be at least {low}"
            problem = "must be positive" if (low, high) == (1, None) else problem
            good = s.default if (low is None or s.default >= low) and (high is None or s.default <= high) else low
        else:
            continue
        if value == s.default:
            raise UserError(
                f"{s.name}: {s.kind.__name__} = {value!r} at the top of train_distribute.py {problem}; "
                f"write e.g. {s.name}: {s.kind.__name__} = {good}"
            )
        raise UserError(f"{s.name}={value!r} {problem}; e.g. {s.option} {good}")


def check_against_machine(cfg: SimpleNamespace, world_size: int, gpus: int) -> None:
    """The settings that depend on the ranks and the hardware."""
    if cfg.BATCH_SIZE % (world_size * cfg.ACCUMULATE):
        raise UserError(
            f"BATCH_SIZE={cfg.BATCH_SIZE} does not split evenly over {world_size} ranks x {cfg.ACCUMULATE} "
            f"micro-batches; use a multiple of {world_size * cfg.ACCUMULATE}"
        )
    if cfg.SYNC_BN and not gpus:
        raise UserError("SYNC_BN=True needs GPUs (torch's SyncBatchNorm runs on CUDA only); use --sync_bn False")


def check_resume(saved: dict[str, Any], cfg: SimpleNamespace, restarted_by: str = "") -> None:
    """A resumed run continues the same run: every setting outside FREE_ON_RESUME as the checkpoint's. A setting
    added since the checkpoint was written counts as its default there. `restarted_by`: what made this start a
    restart (torchrun's or SLURM's count), which resumes by itself: the user set no RESUME, and cannot start anew."""
    for name, value in vars(cfg).items():
        was = saved.get(name, DEFAULTS.get(name))
        if name in FREE_ON_RESUME or was == value:
            continue
        if restarted_by:
            raise UserError(
                f"this start is a restart ({restarted_by}) of the run in {cfg.OUTPUT_DIR}, whose checkpoint has "
                f"{name}={was!r} where the settings now say {value!r} (the script or the command changed since the "
                f"run began); set {name} back to {was!r} to continue it, or end the job and start a new run in "
                f"another --output_dir"
            )
        raise UserError(
            f"RESUME=True but {name}={value!r} differs from the checkpoint's {was!r}; "
            f"resume with --{name.lower()} {was}, or start a new run"
        )


# ----------------------------------------------------------------------------- the command line


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming the fix instead of usage text and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message}; write settings as --name value or --name=value (--help lists them)")


def _parser(settings: list[Setting]) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="train_distribute.py", description=DESCRIPTION, allow_abbrev=False)
    groups: dict[tuple[str, str], Any] = {}
    for s in settings:
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group[0], s.group[1] or None)
        metavar = "{" + ",".join(s.choices) + "}" if s.choices else METAVARS[s.kind]
        options: dict[str, Any] = {"nargs": "?", "const": "True"} if s.kind is bool else {}
        help_text = f"{s.help} (default: {s.default})".replace("%", "%%")
        groups[s.group].add_argument(
            s.option, dest=s.name, default=s.default, metavar=metavar, help=help_text, **options
        )
    return parser


def _unknown_argument(argument: str, settings: list[Setting]) -> str:
    if not argument.startswith("--"):
        return f"cannot read argument {argument!r}; write settings as --name value or --name=value, e.g. --epochs 5"
    name = argument[2:].partition("=")[0]
    close = difflib.get_close_matches(name.lower(), [s.name.lower() for s in settings], n=1)
    hint = f"did you mean --{close[0]}? " if close else ""
    return f"unknown setting --{name}; {hint}python train_distribute.py --help lists the settings"
