"""The recipe's switches: the optimizer, label smoothing, flip test-time augmentation, and the seed's
recipe end to end."""

import os
import shutil

import pytest
import resume
import torch
import torch.nn.functional as F
from outputs import load_checkpoint
from processes import UserError, free_port

import muon
import train_distribute as td
from distribute_tools import cleanup, setup
from tests.conftest import TINY, read_config


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
        assert acc == (logits.argmax(1) == y).sum().item() / len(y)  # counts: exact
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


def test_the_default_optimizer_is_muon_and_plain_nesterov_sgd_is_one_setting_away():
    model = td.make_model(read_config(TINY), 10)
    default = td.make_optimizer(read_config(TINY), model, torch.device("cpu"), bf16=False)
    assert isinstance(default, muon.MuonSGD) and default.defaults["muon_scale"] == read_config(TINY).MUON_SCALE
    sgd = td.make_optimizer(read_config([*TINY, "--optimizer=sgd"]), model, torch.device("cpu"), bf16=False)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.9
    assert [len(g["params"]) for g in sgd.param_groups] == [len(list(model.parameters()))]
