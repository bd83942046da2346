"""The settings block at the top of train_distribute.py as the command line (safeguards/settings.py), the resume rule
over the settings, DATASET against DATA_DIR, and the learning-rate schedule. In-process: no ranks."""

import importlib.util
import itertools
import math
import os
import re
import typing
from types import SimpleNamespace

import pytest

import train_distribute as td
from safeguards import settings
from safeguards.failures import UserError
from tests.conftest import ROOT, SCRIPT, SETTINGS, python_path, read_config, run_script, snapshot

RESTART = "TORCHELASTIC_RESTART_COUNT=1"


def comments_in_the_file() -> dict[str, str]:
    """Each setting's comment, read from the file's lines (`NAME: type = value  # comment`)."""
    found = {}
    for line in SCRIPT.read_text().splitlines():
        match = re.match(r"([A-Z][A-Z0-9_]*): .*?  # (.*)$", line)
        if match:
            found[match[1]] = match[2].strip()
    return found


def another_value(name: str) -> typing.Any:
    """A valid value of the setting other than its default."""
    default, choices = getattr(td, name), typing.get_args(SETTINGS[name])
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):
        return default + "-other"
    return default + 1 if isinstance(default, int) else default / 2 + 0.25


def edited_copy(tmp_path, monkeypatch, name: str, value: str) -> typing.Any:
    """train_distribute.py with the value of one setting of its block edited (whatever the block says now), imported
    as a module of its own."""
    edit = re.compile(rf"^({name}: [^=]+= ).*?(  # )", re.MULTILINE)
    text, found = edit.subn(lambda line: line[1] + value + line[2], SCRIPT.read_text(), count=1)
    assert found == 1, name
    copy = tmp_path / "train_distribute.py"
    copy.write_text(text)
    spec = importlib.util.spec_from_file_location("edited_train_distribute", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(settings, "DEFAULTS", {})  # reading the copy must not change the real script's defaults
    return module


# ----------------------------------------------------------------------------- reading the command line


def test_defaults_are_the_constants_at_the_top():
    assert vars(read_config([])) == {name: getattr(td, name) for name in SETTINGS}
    assert settings.DEFAULTS == {name: getattr(td, name) for name in SETTINGS}


def test_name_value_and_name_equals_value_both_work():
    cfg = read_config(["--epochs", "3", "--lr=1", "--dataset", "synthetic", "--data_dir=/x", "--label_smoothing", "0"])
    assert (cfg.EPOCHS, cfg.LR, cfg.DATASET, cfg.DATA_DIR, cfg.LABEL_SMOOTHING) == (3, 1.0, "synthetic", "/x", 0.0)
    assert type(cfg.LR) is float and type(cfg.EPOCHS) is int
    assert read_config(["--num_workers", "-1"]).NUM_WORKERS == -1  # a negative number is a value, not an option
    assert read_config(["--epochs=2", "--epochs=4"]).EPOCHS == 4  # the last one counts


@pytest.mark.parametrize(
    "spelling, value", [("True", True), ("true", True), ("1", True), ("False", False), ("false", False), ("0", False)]
)
def test_boolean_spellings(spelling, value):
    cfg = read_config([f"--resume={spelling}", "--tta", spelling])
    assert cfg.RESUME is value and cfg.TTA is value


def test_a_bare_boolean_flag_means_true():
    assert read_config(["--resume"]).RESUME is True and read_config([]).RESUME is False
    assert read_config(["--resume", "--epochs=3"]).RESUME is True  # the next option is not its value


def test_help_lists_every_setting_with_its_default_choices_and_comment(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # one line per setting: no word of a comment wrapped or hyphen split
    with pytest.raises(SystemExit) as done:
        read_config(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    comments = comments_in_the_file()
    assert set(comments) == set(SETTINGS)  # every setting has a comment on its line
    for name, kind in SETTINGS.items():
        choices, default = typing.get_args(kind), getattr(td, name)
        metavar = "{" + ",".join(choices) + "}" if choices else "[BOOL]" if kind is bool else kind.__name__.upper()
        assert f"--{name.lower()} {metavar} {comments[name]} (default: {default})" in text, name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs=2.5"], "--epochs=2.5 is not an integer, e.g. 1"),
        (["--lr=abc"], "--lr=abc is not a number, e.g. 0.1"),
        (["--lr=nan"], "--lr=nan is not a number"),
        (["--lr=inf"], "--lr=inf is not a number"),
        (["--resume=maybe"], "--resume=maybe is not True or False"),
        (["--epochs=0"], "EPOCHS=0 on the command line is out of range: it must be at least 1"),
        (["--batch_size=-4"], "BATCH_SIZE=-4 on the command line is out of range: it must be at least 1"),
        (["--lr=0"], "LR=0.0 on the command line is out of range: it must be at least 1e-12"),
        (["--warmup=1.5"], "WARMUP=1.5 on the command line is out of range: it must be from 0 to 1"),
        (["--momentum=1"], "MOMENTUM=1.0 on the command line is out of range: it must be from 0 to 0.999"),
        (["--num_workers=-2"], "NUM_WORKERS=-2 on the command line is out of range: it must be at least -1"),
        (["--image_size=4"], "IMAGE_SIZE=4 on the command line is out of range: it must be at least 8"),
        (["--dataset=imagenet"], "invalid choice: 'imagenet' (choose from 'cifar10', 'imagefolder', 'synthetic')"),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
        (["--optimiser=sgd"], "unknown setting --optimiser; write settings as --name value or --name=value"),
        (["--no_such_thing=1"], "unknown setting --no_such_thing;"),
        (["--epoch=5"], "unknown setting --epoch; write settings"),  # no abbreviations
        (["--epochs"], "argument --epochs: expected one argument"),
        (["epochs=3"], "unrecognized arguments: epochs=3"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_fix(argv, message):
    with pytest.raises(UserError) as error:
        read_config(argv)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_limits_themselves_are_allowed():
    """Every limit names a setting (WIDTH, the ResNet's knob, may be gone: README's network swap deletes it), and its
    bounds are allowed values."""
    assert set(settings.LIMITS) - {"WIDTH"} <= set(SETTINGS) and settings.FREE_ON_RESUME <= set(SETTINGS)
    limits = {name: bounds for name, bounds in settings.LIMITS.items() if name in SETTINGS}
    lowest = {name: low for name, (low, _) in limits.items()}
    highest = {name: high for name, (_, high) in limits.items() if high is not None}
    for limits in (lowest, highest):
        cfg = read_config([f"--{name.lower()}={value}" for name, value in limits.items()])
        assert {name: getattr(cfg, name) for name in limits} == limits


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("EPOCHS", '"5"', "EPOCHS = '5' at the top of {file} is not an integer"),
        ("EPOCHS", "2.0", "EPOCHS = 2.0 at the top of {file} is not an integer"),
        ("TTA", "1", "TTA = 1 at the top of {file} is not True or False"),
        ("SEED", "False", "SEED = False at the top of {file} is not an integer"),
        ("LR", '"fast"', "LR = 'fast' at the top of {file} is not a number"),
        ("OPTIMIZER", '"lion"', "OPTIMIZER = 'lion' at the top of {file} is not one of sgd, adam, muon"),
        ("EPOCHS", "0", "EPOCHS=0 at the top of train_distribute.py is out of range"),
    ],
)
def test_a_wrong_value_in_the_file_itself_is_named(tmp_path, monkeypatch, name, value, message):
    script = edited_copy(tmp_path, monkeypatch, name, value)
    with pytest.raises(UserError) as error:
        settings.read(script, [])
    assert message.format(file=script.__file__) in str(error.value) and "\n" not in str(error.value)


def test_a_copy_of_the_file_with_good_values_reads_its_own_defaults(tmp_path, monkeypatch):
    script = edited_copy(tmp_path, monkeypatch, "EPOCHS", "7")
    assert settings.read(script, []).EPOCHS == 7 and settings.read(script, ["--epochs=2"]).EPOCHS == 2


def test_cifar10_with_an_image_folder_for_data_dir_is_refused_before_anything_is_written_there(tmp_path):
    """DATASET=cifar10 (the default) where --dataset imagefolder was meant: a real run refuses in one line, with no
    download and no lock file among the user's images (data.prepare: in the launcher, and under torchrun every rank)."""
    images = tmp_path / "images"
    (images / "train" / "cat").mkdir(parents=True)
    (images / "train" / "cat" / "0.png").write_bytes(b"an image")
    before = snapshot(images)
    result = run_script(
        "--dataset=cifar10", "--image_size=32", f"--data_dir={images}", f"--output_dir={tmp_path / 'out'}"
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr
        == f"error: DATA_DIR {images} holds train/<class>/ folders, no CIFAR-10; add --dataset imagefolder\n"
    )
    assert snapshot(images) == before


def test_every_setting_is_read_somewhere_besides_the_settings_module():
    """A setting that nothing reads would take any value in silence (`--loader memory` streamed)."""
    sources = [
        p for p in SCRIPT.parent.rglob("*.py") if p.parts[len(SCRIPT.parent.parts)] not in ("tests", "benchmarks")
    ]
    code = "\n".join(p.read_text() for p in sources if p.name != "settings.py")
    unread = [name for name in SETTINGS if not re.search(rf"\.{name}\b", code)]
    assert unread == [], f"read nowhere but by safeguards/settings.py: {unread}"


def test_the_suites_runs_keep_the_users_pythonpath_behind_the_project(monkeypatch):
    """A package of the user's on PYTHONPATH (timm for make_model, say) stays importable in the suite's runs."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/theirs", "/opt/more"]))
    assert python_path().split(os.pathsep) == [str(ROOT), "/opt/theirs", "/opt/more"]


# ----------------------------------------------------------------------------- the resume rule


def resumed(argv: list[str], saved: dict, restart: str = "") -> tuple[SimpleNamespace, list[str]]:
    return settings.resumed(read_config(argv), saved, restart)


def test_a_resume_goes_on_with_the_checkpoints_settings_whatever_the_block_says_now():
    """`--output_dir X --resume True` alone: every setting the checkpoint's, where it is and that it resumes now's."""
    saved = {name: another_value(name) for name in SETTINGS} | {"WORLD_SIZE": 2}
    saved["DATASET"] = next(data for data in ("synthetic", "imagefolder") if data != td.DATASET)  # any IMAGE_SIZE
    batches = range(64 * saved["ACCUMULATE"], 10**6, 2 * saved["ACCUMULATE"])  # split over 2 ranks, not the block's
    saved["BATCH_SIZE"] = next(batch for batch in batches if batch != td.BATCH_SIZE)
    cfg, said = resumed(["--output_dir=/runs/a", "--resume"], saved)
    assert vars(cfg) == saved | {"OUTPUT_DIR": "/runs/a", "RESUME": True}
    taken = sorted(set(SETTINGS) - {"OUTPUT_DIR", "RESUME"})
    assert said == [
        f"the checkpoint's settings, not the block's: {', '.join(f'{n}={saved[n]!r}' for n in SETTINGS if n in taken)}"
    ]


def test_the_command_line_changes_on_resume_only_what_a_resume_may_change():
    """FREE_ON_RESUME, and EPOCHS upwards; a value that changes any other setting is refused in one line, and one
    that repeats the checkpoint's is accepted (restarts repeat the full command)."""
    saved = vars(read_config(["--epochs=1", "--batch_size=5040", "--world_size=2"]))  # 5040: split by 1 to 10
    for name in sorted(set(SETTINGS) - {"RESUME"}):
        value = another_value(name)
        argv = [f"--{name.lower()}={value}", "--resume"]
        if name in settings.FREE_ON_RESUME or name == "EPOCHS":
            assert getattr(resumed(argv, saved)[0], name) == value, name
        else:
            with pytest.raises(UserError, match=f"^RESUME=True: {name}=.* differs from the checkpoint's .*; resume wi"):
                resumed(argv, saved)
        assert getattr(resumed([f"--{name.lower()}={saved[name]}", "--resume"], saved)[0], name) == saved[name]


def test_epochs_grow_on_resume_only_and_the_first_lines_say_so():
    saved = vars(read_config(["--epochs=5", "--batch_size=48", "--accumulate=1", "--output_dir=/runs/a"]))
    cfg, said = resumed(["--epochs=8", "--resume"], saved)
    assert cfg.EPOCHS == 8 and said[-1:] == [
        "extended from 5 to 8 epochs: the schedule is recomputed over 8, so the numbers differ from those of a run "
        "started with --epochs 8"
    ]
    with pytest.raises(UserError, match="^RESUME=True: EPOCHS=3 differs from the checkpoint's 5 in /runs/a; resume wi"):
        resumed(["--epochs=3", "--resume", "--output_dir=/runs/a"], saved)
    with pytest.raises(UserError, match=f"^this start is a restart \\({RESTART}\\): EPOCHS=8 differs"):
        resumed(["--epochs=8"], saved, restart=RESTART)  # a restart repeats its command: it changes nothing


def test_a_setting_added_after_the_checkpoint_resumes_at_its_default():
    """A checkpoint written before a setting existed: the default continues it; another value is refused in a line
    that names the fix."""
    now = vars(read_config([]))
    for added in sorted(set(SETTINGS) - settings.FREE_ON_RESUME - {"EPOCHS"}):
        older = {name: value for name, value in now.items() if name != added}
        assert vars(resumed([], older)[0]) == now
        with pytest.raises(UserError) as refusal:
            resumed([f"--{added.lower()}={another_value(added)}"], older)
        assert f"; resume without --{added.lower()}, or start a new run" in str(refusal.value)
        assert "\n" not in str(refusal.value)


def test_a_changed_setting_in_a_restart_says_how_to_continue_the_job():
    saved = vars(read_config(["--lr=0.5", "--output_dir=/runs/a"]))
    with pytest.raises(UserError) as refusal:
        resumed(["--lr=0.25", "--output_dir=/runs/a"], saved, restart=RESTART)
    message = str(refusal.value)
    assert message.startswith(
        f"this start is a restart ({RESTART}): LR=0.25 differs from the checkpoint's 0.5 in /runs/a"
    )
    assert "; set LR back to 0.5" in message
    assert "another --output_dir" in message and "--resume" not in message and "\n" not in message


def test_the_batch_must_split_evenly_over_ranks_and_micro_batches():
    settings.check(read_config(["--batch_size=48", "--world_size=2", "--accumulate=3"]))
    with pytest.raises(UserError) as refusal:
        settings.check(read_config(["--batch_size=48", "--world_size=2", "--accumulate=5"]))
    assert str(refusal.value) == "BATCH_SIZE=48 does not split evenly over 2 ranks x 5 micro-batches; use a multiple"


def test_a_resume_is_checked_with_the_checkpoints_batch_and_a_refusal_names_it_and_what_a_resume_may_change(
    tmp_path, monkeypatch
):
    """A resume goes on with the checkpoint's BATCH_SIZE (48): the block's (here 512) never refuses it, and one that
    does not split over the ranks now is refused naming the checkpoint's value and the settings a resume may change."""
    saved = vars(read_config(["--batch_size=48", "--accumulate=1"]))
    block = edited_copy(tmp_path, monkeypatch, "BATCH_SIZE", "512")
    assert settings.check(settings.read(block, ["--resume", "--world_size=3", "--accumulate=1"])).BATCH_SIZE == 512
    assert resumed(["--resume", "--world_size=3"], saved)[0].BATCH_SIZE == 48
    with pytest.raises(UserError) as refusal:
        resumed(["--resume", "--world_size=5"], saved)
    assert str(refusal.value) == (
        "BATCH_SIZE=48, the checkpoint's, does not split evenly over 5 ranks; resume with a --world_size or "
        "--accumulate that splits it"
    )
    with pytest.raises(UserError, match="^BATCH_SIZE=512 does not split evenly over 3 ranks; use a multiple$"):
        settings.check(settings.read(block, ["--world_size=3", "--accumulate=1"]))  # a new run: the block's value


# ----------------------------------------------------------------------------- the learning rate


def test_onecycle_warms_up_peaks_and_ends_near_zero():
    total, peak = 100, 0.4
    lrs = [td.lr_at(step, total, peak, "onecycle", warmup=0.2) for step in range(total)]
    assert lrs[0] == pytest.approx(peak / 20)  # warm-up starts near 0 ...
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) in (19, 20)  # ... peaks after 20% of the steps
    assert all(a < b for a, b in zip(lrs[:19], lrs[1:20], strict=True))  # rises linearly
    assert all(a > b for a, b in zip(lrs[20:], lrs[21:], strict=False))  # then falls linearly
    assert lrs[-1] == pytest.approx(peak / 80)  # to (almost) 0 at the last step
    assert all(0 < lr <= peak for lr in lrs)


def test_onecycle_and_cosine_with_a_few_steps_or_no_warm_up_stay_in_range():
    for schedule, (total, warmup) in itertools.product(("onecycle", "cosine"), ((1, 0.2), (3, 0.0), (5, 1.0))):
        lrs = [td.lr_at(step, total, 1.0, schedule, warmup) for step in range(total)]
        assert all(0 < lr <= 1.0 for lr in lrs) and max(lrs) == pytest.approx(1.0), (schedule, total, warmup, lrs)


def test_cosine_warms_up_as_onecycle_then_falls_as_half_a_cosine_wave():
    total, peak = 100, 0.4
    lrs, onecycle = (
        [td.lr_at(step, total, peak, s, warmup=0.2) for step in range(total)] for s in ("cosine", "onecycle")
    )
    assert lrs[:20] == onecycle[:20] and lrs[19] == pytest.approx(peak)  # the same warm-up to the peak
    for step in (20, 40, 60, 80, 99):  # then peak x (1 + cos(pi x the share of the decay done)) / 2
        done = (step - 20) / 80
        assert lrs[step] == pytest.approx(peak * (1 + math.cos(math.pi * done)) / 2), step
    assert lrs[60] == pytest.approx(peak / 2) and lrs[40] > onecycle[40] and lrs[80] < onecycle[80]  # not linear


def test_the_constant_schedule_is_the_seeds():
    assert {td.lr_at(step, 50, 1e-3, "constant", warmup=0.2) for step in range(50)} == {1e-3}


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_sgd_and_muon_scale_the_lr_with_the_global_batch(optimizer):
    assert td.peak_lr(read_config([f"--optimizer={optimizer}", "--lr=0.4", "--batch_size=1024"])) == pytest.approx(0.8)
    assert td.peak_lr(read_config([f"--optimizer={optimizer}", "--lr=0.4", "--batch_size=512"])) == pytest.approx(0.4)


def test_adams_lr_is_used_as_given():
    assert td.peak_lr(read_config(["--optimizer=adam", "--lr=1e-3", "--batch_size=1024"])) == pytest.approx(1e-3)
