"""The settings of a run: read from the constants block of train_distribute.py, overridden on the command line.

The block is the one place where a setting is written. Each line there has the form

    NAME: type = value  # what it does

with type int, float, bool, str or Literal["a", "b"] (a choice). This module reads that block
from the script's source (names, types, values and comments, in order; comment lines above a
group of settings become its heading), and derives from it:
    the command line     `--name value` or `--name=value`, `--help` listing every setting
    the checks           a value of the wrong type, in the file or on the command line, is one line
    the resume check     a resumed run must share every setting except those in FREE_ON_RESUME
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

from distribute_tools import UserError

# Settings that may differ between a run and its resumption: where files are, how the run is launched
# and on what hardware, and how it evaluates or reports. Every other setting shapes the run itself, so a
# new setting is checked on resume unless it is added here.
FREE_ON_RESUME = (
    "DATA_DIR",
    "OUTPUT_DIR",
    "RESUME",
    "WORLD_SIZE",
    "AMP",
    "COMPILE",
    "SYNC_BN",
    "ACCUMULATE",
    "BF16_ALLREDUCE",
    "TTA",
    "COLLECTIVE_TIMEOUT",
    "PROGRESS_EVERY",
)

# Allowed ranges: (lowest, highest), None where open.
LIMITS = {
    "EPOCHS": (1, None),
    "BATCH_SIZE": (1, None),
    "WIDTH": (1, None),
    "SYNTHETIC_SIZE": (1, None),
    "ACCUMULATE": (1, None),
    "COLLECTIVE_TIMEOUT": (1, None),
    "PROGRESS_EVERY": (1, None),
    "WARMUP": (0, 1),
    "LABEL_SMOOTHING": (0, 0.99),
    "MOMENTUM": (0, 0.999),
    "WEIGHT_DECAY": (0, 1),
}
KIND_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "text"}
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


# ----------------------------------------------------------------------------- the block in the source


def read_settings(script: str) -> list[Setting]:
    """Every `NAME: type = value  # comment` line at the top level of `script`, in order."""
    with open(script, encoding="utf-8") as f:
        source = f.read()
    comments = _comments_by_line(source)
    lines = source.splitlines()
    body = ast.parse(source).body
    annotated = [
        node
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.isupper()
    ]
    settings: list[Setting] = []
    for node in body:
        if node in annotated:
            settings.append(_setting(node, comments, lines, settings[-1].group if settings else ("settings", "")))
        elif annotated and annotated[0].lineno < node.lineno < annotated[-1].lineno and _assigns_upper_name(node):
            name = node.targets[0].id  # type: ignore[attr-defined]
            raise UserError(
                f"{name} at line {node.lineno} of {script} has lost its type; write it as "
                f"{name}: int = ... (or float, bool, str) like the settings around it"
            )
    return settings


def _setting(node: ast.AnnAssign, comments: dict[int, str], lines: list[str], group: tuple[str, str]) -> Setting:
    name = node.target.id  # type: ignore[attr-defined]
    kind, choices = _kind(node.annotation, name)
    try:
        default = ast.literal_eval(node.value) if node.value is not None else None
    except ValueError:
        raise UserError(
            f"{name} at line {node.lineno} of train_distribute.py must be a plain value "
            f"(a number, True/False or text in quotes)"
        ) from None
    heading = []
    line = node.lineno - 1  # lines are 1-based: lines[line - 1] is the one above
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


def _assigns_upper_name(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.isupper()
    )


# ----------------------------------------------------------------------------- types and values


def _check_type(setting: Setting, value: Any, where: str) -> None:
    kind = setting.kind
    fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        fits = True
    if not fits:
        raise UserError(
            f"{where} is not {KIND_NAMES[kind]}; write e.g. {setting.name}: {kind.__name__} = {_example(setting)}"
        )
    if setting.choices and value not in setting.choices:
        raise UserError(f"{setting.name}={value!r} is unknown; use one of {', '.join(setting.choices)}")


def _example(setting: Setting) -> str:
    if isinstance(setting.default, setting.kind):
        return repr(setting.default)
    return {int: "1", float: "0.1", bool: "True", str: '"text"'}[setting.kind]


def parse_value(setting: Setting, text: str) -> Any:
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


# ----------------------------------------------------------------------------- the command line


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming the fix instead of usage text and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(
            f"{message}; write settings as --name value or --name=value (python train_distribute.py --help lists them)"
        )


def build_parser(settings: list[Setting], description: str) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="train_distribute.py",
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups: dict[tuple[str, str], Any] = {}
    for s in settings:
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group[0], s.group[1] or None)
        metavar = (
            "{" + ",".join(s.choices) + "}" if s.choices else {int: "N", float: "X", bool: "BOOL"}.get(s.kind, "TEXT")
        )
        help_text = f"{s.help} (default: {s.default})".replace("%", "%%")
        options: dict[str, Any] = {"nargs": "?", "const": "True"} if s.kind is bool else {}
        groups[s.group].add_argument(
            s.option, dest=s.name, default=s.default, metavar=metavar, help=help_text, **options
        )
    return parser


def read_config(settings: list[Setting], argv: list[str], description: str = "") -> SimpleNamespace:
    """The settings' values with the command line's applied, each checked against its type."""
    parser = build_parser(settings, description)
    values, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(_unknown_argument(unknown[0], settings))
    for s in settings:
        value = getattr(values, s.name)
        if isinstance(value, str) and s.kind is not str:
            value = parse_value(s, value)
        _check_type(s, value, where=f"{s.option}={value}")
        setattr(values, s.name, value)
    return SimpleNamespace(**vars(values))


def _unknown_argument(argument: str, settings: list[Setting]) -> str:
    if not argument.startswith("--"):
        return f"cannot read argument {argument!r}; write settings as --name value or --name=value, e.g. --epochs 5"
    name = argument[2:].partition("=")[0]
    close = difflib.get_close_matches(name.lower(), [s.name.lower() for s in settings], n=1)
    hint = f"did you mean --{close[0]}? " if close else ""
    return f"unknown setting --{name}; {hint}python train_distribute.py --help lists the settings"


# ----------------------------------------------------------------------------- checks


def check_limits(cfg: SimpleNamespace, settings: list[Setting]) -> None:
    """Every value inside its allowed range; one line naming the setting and a good value otherwise."""
    defaults = {s.name: s.default for s in settings}
    for name, (low, high) in LIMITS.items():
        value = getattr(cfg, name)
        if high is None and value < low:
            problem = "must be positive" if low == 1 else f"must be at least {low}"
        elif high is not None and not low <= value <= high:
            problem = f"is outside {low}..{high}"
        else:
            continue
        raise UserError(f"{name}={value} {problem}; e.g. --{name.lower()} {defaults[name]}")
    if not cfg.LR > 0:
        raise UserError(f"LR={cfg.LR} must be a positive number; e.g. --lr {defaults['LR']}")


def check_resume(saved: dict[str, Any], cfg: SimpleNamespace) -> None:
    """A resumed run continues the same run: every setting outside FREE_ON_RESUME as the checkpoint's."""
    for name, value in vars(cfg).items():
        if name not in FREE_ON_RESUME and saved.get(name) != value:
            raise UserError(
                f"RESUME=True but {name}={value!r} differs from the checkpoint's {saved.get(name)!r}; "
                f"resume with --{name.lower()} {saved.get(name)}, or start a new run"
            )
