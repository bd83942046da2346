"""The recipe's switches: label smoothing, flip test-time augmentation, and the seed's recipe end to end."""

import os
import shutil

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import resume
import train_distribute as td
from distribute_tools import cleanup, setup
from outputs import load_checkpoint
from processes import UserError, free_port
from tests.conftest import TINY, read_config, run_script


@pytest.fixture
def one_rank():
    """A real process group of one rank (gloo) inside the test process."""
    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    d = setup(0, 1, timeout_s=60)
    yield d
    cleanup(every_rank_leaves=True)
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_label_smoothing_is_the_constants(smoothing):
    logits, targets = torch.randn(16, 10), torch.randint(10, (16,))
    loss = td.loss_function(read_config([f"--label_smoothing={smoothing}"]))(logits, targets)
    log_p = F.log_softmax(logits, dim=1)
    smooth_target = torch.full_like(log_p, smoothing / 10).scatter_(1, targets[:, None], 1 - smoothing + smoothing / 10)
    torch.testing.assert_close(loss, -(smooth_target * log_p).sum(1).mean())


def test_tta_switch_averages_each_image_with_its_mirror(reference_run, one_rank):
    out, _, _ = reference_run
    cfg = read_config([*TINY, "--world_size=1", f"--output_dir={out}", "--amp=False"])
    run = td.build_run(cfg, one_rank, launched_at=0.0)
    run.model.load_state_dict(load_checkpoint(str(out))["model"])
    results = {}
    for tta in (False, True):
        run.cfg.TTA = tta
        results[tta] = td.evaluate(run)
    run.model.eval()
    with torch.no_grad():
        x, y = next(run.test_data.eval_batches(1, 0, batch_size=len(run.test_data)))
        plain, mirrored = run.model(x), run.model(x.flip(3))
    for tta, logits in ((False, plain), (True, (plain + mirrored) / 2)):
        loss, acc = results[tta]
        assert acc == (logits.argmax(1) == y).float().mean().item()
        assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert results[True][0] != results[False][0]


def test_a_resume_on_other_data_is_refused(reference_run, one_rank, tmp_path):
    """Same settings, but other images (an image folder that changed): one line, and nothing is loaded."""
    out, _, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    cfg = read_config([*TINY, "--world_size=1", "--epochs=5", f"--output_dir={folder}", "--amp=False", "--resume=True"])
    run = td.build_run(cfg, one_rank, launched_at=0.0)
    other = {**run.data, "identity": run.data["identity"].replace("600 train", "600 other train")}
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(UserError, match="was trained on other data .*; resume on the same data"):
        with resume.start(cfg, one_rank, other, run.model, run.optimizer):
            pass
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())


def test_seed_recipe_runs_end_to_end(tmp_path):
    seed_recipe = [
        "--optimizer=adam",
        "--lr=1e-3",
        "--schedule=constant",
        "--weight_decay=0",
        "--label_smoothing=0",
        "--augment=False",
        "--tta=False",
        "--relu_after_sum=False",
    ]
    result = run_script(*TINY, *seed_recipe, "--epochs=3", f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "seed blocks" in result.stdout and "adam peak lr 0.001" in result.stdout
    df = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert df["lr"].tolist() == [1e-3] * 3
    assert df["acc"].iloc[-1] > 0.3, "10 classes: chance is 0.1"


def test_tta_shifts_average_the_weighted_views(reference_run, one_rank):
    out, _, _ = reference_run
    cfg = read_config([*TINY, "--world_size=1", f"--output_dir={out}", "--amp=False", "--tta_shifts=True"])
    run = td.build_run(cfg, one_rank, launched_at=0.0)
    run.model.load_state_dict(load_checkpoint(str(out))["model"])
    loss, acc = td.evaluate(run)
    run.model.eval()
    with torch.no_grad():
        x, y = next(run.test_data.eval_batches(1, 0, batch_size=len(run.test_data)))
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        views = [x, padded[..., :-2, :-2], padded[..., 2:, 2:]]
        pairs = [(run.model(v) + run.model(v.flip(3))) / 2 for v in views]
        logits = pairs[0] / 2 + (pairs[1] + pairs[2]) / 4
    assert acc == (logits.argmax(1) == y).float().mean().item()
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


@pytest.mark.parametrize("decay_all", [True, False])
def test_weight_decay_on_norm_and_bias_parameters_is_a_switch(one_rank, decay_all):
    cfg = read_config([*TINY, "--world_size=1", f"--norm_bias_decay={decay_all}"])
    model = td.make_model(cfg, 10)
    optimizer = td.make_optimizer(cfg, model, torch.device("cpu"))
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert set(decay) == {id(p) for p in model.parameters()}  # every parameter once
    for p in model.parameters():
        expected = cfg.WEIGHT_DECAY if decay_all or p.ndim > 1 else 0.0
        assert decay[id(p)] == expected
    if decay_all:  # off, the optimizer is the plain one it was: one group of every parameter
        assert len(optimizer.param_groups) == 1


def test_ema_weights_are_what_evaluation_and_the_checkpoint_use(one_rank, tmp_path):
    cfg = read_config([*TINY, "--world_size=1", "--amp=False", "--ema=0.5", f"--output_dir={tmp_path}"])
    run = td.build_run(cfg, one_rank, launched_at=0.0)
    snapshots = []
    for x, y in list(run.train_data.train_batches(cfg.BATCH_SIZE, 1, 0, cfg.SEED, 1))[:3]:
        td.train_step(run, x, y, 0.05, torch.nn.CrossEntropyLoss(), torch.zeros(3))
        snapshots.append({k: v.detach().clone() for k, v in run.model.named_parameters()})
    for name, p in run.averaged.module.named_parameters():  # the first copy, then halfway to each new step
        expected = snapshots[0][name]
        for later in snapshots[1:]:
            expected = 0.5 * expected + 0.5 * later[name]
        torch.testing.assert_close(p, expected)
    saved = td.checkpoint(run, [{"epoch": 1}])["model"]
    assert all(torch.equal(saved[k], v) for k, v in run.averaged.module.state_dict().items())
    loss, acc = td.evaluate(run)
    plain = td.Run(**{**run.__dict__, "model": run.averaged.module, "averaged": None})
    assert (loss, acc) == td.evaluate(plain)  # evaluation used the averaged weights
