"""Settings: --name=value overrides, validation, and the learning-rate schedule (in-process, no workers)."""
import pytest

import train_distribute as td
from distribute_tools import UserError


def test_defaults_are_the_constants_at_the_top():
    cfg = td.read_config([])
    assert cfg.EPOCHS == td.EPOCHS and cfg.DATA_DIR == "./data" and cfg.RESUME is False
    for name in ("DATASET", "DATA_DIR", "OUTPUT_DIR", "EPOCHS", "BATCH_SIZE", "LR", "WORLD_SIZE", "WIDTH", "SEED",
                 "RESUME", "COMPILE", "AMP", "TTA", "LABEL_SMOOTHING", "OPTIMIZER"):
        assert name in td.CONSTANTS


def test_overrides_are_typed():
    cfg = td.read_config(["--epochs=3", "--lr=1", "--resume=true", "--amp=False", "--dataset=synthetic",
                          "--label_smoothing=0"])
    assert (cfg.EPOCHS, cfg.LR, cfg.RESUME, cfg.AMP, cfg.DATASET) == (3, 1.0, True, False, "synthetic")
    assert isinstance(cfg.LR, float) and isinstance(cfg.EPOCHS, int) and cfg.LABEL_SMOOTHING == 0.0


@pytest.mark.parametrize("argv,message", [
    (["--no_such_setting=1"], "unknown setting --no_such_setting"),
    (["--epochs=2.5"], "--epochs=2.5 is not an integer"),
    (["--lr=abc"], "--lr=abc is not a number"),
    (["--resume=yes please"], "is not True or False"),
    (["--epochs"], "--name=value"),
    (["epochs=3"], "--name=value"),
])
def test_bad_overrides(argv, message):
    with pytest.raises(UserError, match=message):
        td.read_config(argv)


SYNTHETIC = ["--dataset=synthetic", "--synthetic_size=1000", "--world_size=2", "--batch_size=256"]


@pytest.mark.parametrize("extra,message", [
    (["--epochs=0"], "EPOCHS=0 must be positive"),
    (["--batch_size=-4"], "BATCH_SIZE=-4 must be positive"),
    (["--batch_size=255"], "does not split evenly over 2 ranks"),
    (["--batch_size=2000"], "fewer than one global batch"),
    (["--lr=0"], "LR=0.0 must be a positive number"),
    (["--lr=nan"], "must be a positive number"),
    (["--width=0"], "WIDTH=0 must be positive"),
    (["--world_size=-1"], "WORLD_SIZE=-1 is negative"),
    (["--dataset=imagenet21k"], "DATASET='imagenet21k' is unknown"),
    (["--optimizer=lion"], "OPTIMIZER='lion' is unknown"),
    (["--warmup=1.5"], "WARMUP=1.5 is outside"),
])
def test_validation(extra, message):
    with pytest.raises(UserError, match=message):
        td.validate(td.read_config(SYNTHETIC + extra))


def test_valid_settings_give_the_world_size():
    assert td.validate(td.read_config(SYNTHETIC)) == 2
    assert td.validate(td.read_config(SYNTHETIC + ["--world_size=0"])) == 2  # auto, on a machine without GPUs


def test_resume_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(UserError, match="RESUME=True but there is no"):
        td.validate(td.read_config(SYNTHETIC + ["--resume=True", f"--output_dir={tmp_path}"]))


# ----------------------------------------------------------------------------- schedule


def test_onecycle_warms_up_peaks_and_ends_near_zero():
    total, peak = 100, 0.4
    lrs = [td.lr_at(step, total, peak, "onecycle", warmup=0.2) for step in range(total)]
    assert lrs[0] == pytest.approx(peak / 20)  # warm-up starts near 0 ...
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) in (19, 20)  # ... peaks after 20% of steps
    assert all(a < b for a, b in zip(lrs[:19], lrs[1:20]))  # rises linearly
    assert all(a > b for a, b in zip(lrs[20:], lrs[21:]))  # then falls linearly
    assert lrs[-1] == pytest.approx(peak / 80)  # to (almost) 0 at the last step


def test_constant_schedule_is_the_seeds():
    assert {td.lr_at(step, 50, 1e-3, "constant", warmup=0.2) for step in range(50)} == {1e-3}


def test_sgd_lr_scales_with_the_global_batch_and_adam_does_not():
    sgd = td.read_config(["--lr=0.4", "--batch_size=1024"])
    assert td.peak_lr(sgd) == pytest.approx(0.8)
    adam = td.read_config(["--optimizer=adam", "--lr=1e-3", "--batch_size=1024"])
    assert td.peak_lr(adam) == pytest.approx(1e-3)
