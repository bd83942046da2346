"""Settings: the block at the top of train_distribute.py, the command line built from it, the checks, the
resume rule, and the learning-rate schedule (in-process, no workers)."""

import shutil
import typing

import config
import pytest
from processes import UserError

import train_distribute as td
from tests.conftest import ROOT, read_config, run_script

SETTINGS = config.read_settings(td.__file__)
BY_NAME = {s.name: s for s in SETTINGS}


def test_the_block_is_read_with_types_defaults_comments_and_choices():
    assert list(BY_NAME)[:4] == ["DATASET", "DATA_DIR", "SYNTHETIC_SIZE", "OUTPUT_DIR"]  # in the file's order
    for s in SETTINGS:  # the value in the file is the constant the module defines
        assert getattr(td, s.name) == s.default and s.help, s.name
    assert BY_NAME["EPOCHS"].kind is int and BY_NAME["LR"].kind is float and BY_NAME["RESUME"].kind is bool
    for name, annotation in td.__annotations__.items():  # a Literal's choices, as the module itself declares them
        assert BY_NAME[name].choices == typing.get_args(annotation), name
    assert "cifar10" in BY_NAME["DATASET"].choices and "onecycle" in BY_NAME["SCHEDULE"].choices
    assert BY_NAME["EPOCHS"].help == "passes over the training set"
    assert BY_NAME["DATA_DIR"].group[0] == "data" and BY_NAME["EPOCHS"].group[0] == "recipe"
    assert set(config.LIMITS) <= set(BY_NAME) and set(config.FREE_ON_RESUME) <= set(BY_NAME)


def test_help_lists_every_setting_with_its_default_comment_and_choices():
    result = run_script("--help")
    assert result.returncode == 0 and result.stderr == ""
    text = " ".join(result.stdout.split())  # argparse wraps lines
    for s in SETTINGS:
        assert f"{s.option} " in text, s.name
        assert " ".join(s.help.split()[:4]) in text, s.name
    assert "--epochs N passes over the training set (default: 30)" in text
    assert "--dataset {cifar10,imagefolder,synthetic}" in text and "--optimizer {sgd,adam,muon}" in text
    assert "--schedule {onecycle,constant}" in text


def test_short_help_is_the_same(capsys):
    with pytest.raises(SystemExit) as exit_code:
        read_config(["-h"])
    assert exit_code.value.code == 0 and "--epochs N" in capsys.readouterr().out


def test_name_value_and_name_equals_value_both_work():
    cfg = read_config(["--epochs", "3", "--lr=1", "--dataset", "synthetic", "--data_dir=/x", "--label_smoothing", "0"])
    assert (cfg.EPOCHS, cfg.LR, cfg.DATASET, cfg.DATA_DIR, cfg.LABEL_SMOOTHING) == (3, 1.0, "synthetic", "/x", 0.0)
    assert isinstance(cfg.LR, float) and isinstance(cfg.EPOCHS, int)
    assert read_config(["--world_size", "-1"]).WORLD_SIZE == -1  # a negative number is a value, not an option


@pytest.mark.parametrize(
    "spelling,value", [("True", True), ("true", True), ("1", True), ("False", False), ("false", False), ("0", False)]
)
def test_boolean_spellings(spelling, value):
    assert read_config([f"--resume={spelling}"]).RESUME is value
    assert read_config(["--amp", spelling]).AMP is value


def test_a_bare_boolean_flag_means_true():
    assert read_config(["--compile"]).COMPILE is True and read_config([]).COMPILE is False


def test_defaults_are_the_constants_at_the_top():
    cfg = read_config([])
    assert vars(cfg) == {s.name: s.default for s in SETTINGS}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--no_such_setting=1"], "unknown setting --no_such_setting"),
        (["--epoch=5"], "unknown setting --epoch; did you mean --epochs?"),  # no abbreviations
        (["--epochs=2.5"], "--epochs=2.5 is not an integer"),
        (["--lr=abc"], "--lr=abc is not a number"),
        (["--lr=nan"], "--lr=nan is not a number"),
        (["--resume=yes please"], "is not True or False"),
        (["--epochs"], "argument --epochs: expected one argument"),
        (["epochs=3"], "cannot read argument 'epochs=3'"),
        (["--dataset=imagenet21k"], "DATASET='imagenet21k' is unknown; use one of cifar10, imagefolder, synthetic"),
        (["--optimizer", "lion"], "OPTIMIZER='lion' is unknown"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_fix(argv, message):
    with pytest.raises(UserError, match=message) as error:
        read_config(argv)
    assert "\n" not in str(error.value)


def script_copy(tmp_path, old: str, new: str):
    """A copy of the project with one line of the settings block edited."""
    for source in ROOT.glob("*.py"):
        shutil.copy(source, tmp_path / source.name)
    script = tmp_path / "train_distribute.py"
    text = script.read_text()
    assert old in text
    script.write_text(text.replace(old, new, 1))
    return script


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("EPOCHS: int = 30", "EPOCHS = 30", "EPOCHS at line"),
        ("LR: float = 0.4", 'LR: float = "fast"', "is not a number"),
        (
            'OPTIMIZER: Literal["sgd", "adam", "muon"] = "muon"',
            'OPTIMIZER: Literal["sgd", "adam", "muon"] = "lion"',
            "is unknown",
        ),
    ],
)
def test_a_wrong_value_in_the_file_is_named(tmp_path, old, new, message):
    with pytest.raises(UserError, match=message):
        config.read_settings(str(script_copy(tmp_path, old, new)))


def test_a_wrong_type_in_the_file_is_one_line_before_anything_starts(tmp_path):
    script = script_copy(tmp_path, "EPOCHS: int = 30", "EPOCHS: int = 2.0")
    result = run_script("--epochs=1", script=script, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: EPOCHS = 2.0 at the top of train_distribute.py is not an integer; write e.g. EPOCHS: int = 1"
    ]


SYNTHETIC = ["--dataset=synthetic", "--synthetic_size=1000", "--world_size=2", "--batch_size=256"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--epochs=0"], "EPOCHS=0 must be positive"),
        (["--batch_size=-4"], "BATCH_SIZE=-4 must be positive"),
        (["--batch_size=255"], "does not split evenly over 2 ranks"),
        (["--accumulate=3"], "does not split evenly over 2 ranks x 3 micro-batches"),
        (["--batch_size=2000"], "fewer than one global batch"),
        (["--lr=0"], "LR=0.0 must be a positive number"),
        (["--world_size=-1"], "WORLD_SIZE=-1 is negative"),
        (["--warmup=1.5"], "WARMUP=1.5 is outside 0..1"),
    ],
)
def test_validation(extra, message, tmp_path):
    with pytest.raises(UserError, match=message):
        td.check_before_start(read_config([*SYNTHETIC, *extra, f"--output_dir={tmp_path}/out"]))


def test_valid_settings_give_the_world_size(tmp_path):
    assert td.check_before_start(read_config([*SYNTHETIC, f"--output_dir={tmp_path}"])) == 2
    auto = read_config([*SYNTHETIC, "--world_size=0", f"--output_dir={tmp_path}"])
    assert td.check_before_start(auto) == 2  # on a machine without GPUs


def test_resume_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(UserError, match="RESUME=True but there is no"):
        td.check_before_start(read_config([*SYNTHETIC, "--resume=True", f"--output_dir={tmp_path}"]))


def test_resume_compares_every_setting_but_the_free_ones():
    cfg = read_config([])
    saved = dict(vars(cfg))
    for name in config.FREE_ON_RESUME:  # where files are, how it is launched, how it is evaluated
        config.check_resume({**saved, name: "something else"}, cfg)
    for s in SETTINGS:
        if s.name not in config.FREE_ON_RESUME:
            with pytest.raises(UserError, match=f"{s.name}=.* differs from the checkpoint's"):
                config.check_resume({**saved, s.name: "something else"}, cfg)


@pytest.mark.parametrize("added", [s.name for s in SETTINGS if s.name not in config.FREE_ON_RESUME])
def test_a_setting_added_after_the_checkpoint_resumes_it_at_its_default(added):
    """The checkpoint was written before `added` existed: the default continues it; another value is refused in a
    line whose fix, followed, resumes."""
    older = {name: value for name, value in vars(read_config([])).items() if name != added}
    config.check_resume(older, read_config([]))
    setting = next(s for s in SETTINGS if s.name == added)
    changed = next((c for c in setting.choices if c != setting.default), None) if setting.choices else None
    if changed is None:
        changed = {bool: not setting.default, int: setting.default + 1, float: setting.default / 2 + 0.25}[setting.kind]
    with pytest.raises(UserError) as refusal:
        config.check_resume(older, read_config([f"{setting.option}={changed}"]))
    fix = str(refusal.value).split("resume with ")[1].split(", or")[0].split(" ", 1)
    config.check_resume(older, read_config([f"{fix[0]}={fix[1]}"]))


# ----------------------------------------------------------------------------- schedule


def test_onecycle_warms_up_peaks_and_ends_near_zero():
    total, peak = 100, 0.4
    lrs = [td.lr_at(step, total, peak, "onecycle", warmup=0.2) for step in range(total)]
    assert lrs[0] == pytest.approx(peak / 20)  # warm-up starts near 0 ...
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) in (19, 20)  # ... peaks after 20% of steps
    assert all(a < b for a, b in zip(lrs[:19], lrs[1:20], strict=True))  # rises linearly
    assert all(a > b for a, b in zip(lrs[20:], lrs[21:], strict=False))  # then falls linearly
    assert lrs[-1] == pytest.approx(peak / 80)  # to (almost) 0 at the last step


def test_constant_schedule_is_the_seeds():
    assert {td.lr_at(step, 50, 1e-3, "constant", warmup=0.2) for step in range(50)} == {1e-3}


def test_sgd_lr_scales_with_the_global_batch_and_adam_does_not():
    sgd = read_config(["--lr=0.4", "--batch_size=1024"])
    assert td.peak_lr(sgd) == pytest.approx(0.8)
    adam = read_config(["--optimizer=adam", "--lr=1e-3", "--batch_size=1024"])
    assert td.peak_lr(adam) == pytest.approx(1e-3)


# ----------------------------------------------------------------------------- mistakes in the file itself


def test_a_setting_written_twice_in_the_block_is_one_line(tmp_path):
    script = script_copy(tmp_path, "EPOCHS: int = 30", "EPOCHS: int = 30\nEPOCHS: int = 3")
    result = run_script("--epochs=1", script=script, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "EPOCHS is written twice in the settings block" in lines[0] and "keep one" in lines[0]


def test_a_value_out_of_range_in_the_file_names_the_file_and_a_good_value(tmp_path):
    with pytest.raises(UserError) as error:
        config.read_config(str(script_copy(tmp_path, "EPOCHS: int = 30", "EPOCHS: int = -3")), [])
    assert "EPOCHS: int = -3 at the top of train_distribute.py must be positive" in str(error.value)
    assert "write e.g. EPOCHS: int = 1" in str(error.value) and "-3;" not in str(error.value).split("e.g.")[1]


@pytest.mark.parametrize("name", ["output_dir", "data_dir"])
def test_an_empty_folder_setting_is_refused_at_once(name):
    with pytest.raises(UserError, match=f"{name.upper()}='' is empty; e.g. --{name} "):
        read_config([f"--{name}="])
