"""End to end: the training script with real ranks (2 gloo processes on the CPU) on tiny generated data, each test a
promise of README's: what a run prints and writes, that it learns, that evaluation and steps do not depend on the
world size, that a killed or stopped run resumes exactly, and that one run never harms another's files."""

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch import nn

import distribute_tools
import muon
import train_distribute
from resnet import ResNet
from safeguards import files, settings, start
from tests.conftest import (
    BACKGROUND,
    HANG_TIMEOUT,
    SCRIPT,
    TINY,
    alive,
    call,
    clean_env,
    csv_rows,
    image_folder_of_noise,
    launch,
    model_name,
    needs,
    read_config,
    recorded_ranks,
    run_script,
    scenario,
    snapshot,
    tiny_stream_args,
    width,
)

CLOCKS = {"epoch_seconds", "elapsed_seconds", "images_per_second", "peak_memory_mb", "write_wait_seconds"}
# Two ways to split a step (2 ranks of 24 images or 1 rank of 48, or micro-batches of 12) add the same fp32 products in
# another order. A sum of n terms in another order differs by about sqrt(n) units of rounding (2**-24, relative); a
# step's largest sums are the first convolution's weight gradient over 48 images x 16 x 16 output pixels, and the 2
# epochs of 12 steps carry each step's difference on: 1.6e-4. A bug in sharding or averaging (a gradient not
# all-reduced, the LR scaled by the world size) changes the numbers by percents.
SPLIT_ROUNDING = (48 * 16 * 16) ** 0.5 * 2**-24 * 2 * 12
REFERENCE = [*TINY, "--epochs=5"]  # the settings of the session's reference_run
SHORT = [*TINY, "--synthetic_size=192", "--epochs=5"]  # 4 steps an epoch: a run to stop or break at an epoch's end
ONE_CORE = [0]  # a run of one rank on one core: two threads on a busy machine wait for each other, seconds a step


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def checkpoint_epoch(folder: Path, name: str = "checkpoint.pt") -> int:
    return int(torch.load(folder / name, weights_only=True)["epoch"])


def results(folder: Path) -> dict:
    """Every file's bytes (the lock aside): what a refused start must leave as it was."""
    return {name: data for name, (_, data) in snapshot(folder).items() if name != ".lock"}


def cut_back(folder: Path, epoch: int) -> dict:
    """The checkpoint and CSV in `folder` as if the run had stopped after `epoch`; returns the checkpoint, for a test
    to change and save again."""
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    checkpoint.update(epoch=epoch, history=checkpoint["history"][:epoch])
    torch.save(checkpoint, folder / "checkpoint.pt")
    files.write_csv(checkpoint["history"], str(folder))
    return checkpoint


def copy_stopped_after(out: Path, folder: Path, epoch: int) -> dict:
    """The reference run's files in `folder`, cut back to `epoch`."""
    shutil.copytree(out, folder)
    return cut_back(folder, epoch)


def kill_9(run, pids: Path) -> None:
    """SIGKILL to the launcher and its ranks at once; returns when no rank is left (the lock is free again)."""
    ranks = recorded_ranks(pids)
    run.kill_session()
    run.wait(60)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived its launcher"
        time.sleep(0.02)


def numbers(rows: pd.DataFrame) -> list[str]:
    """The CSV's columns that a run computes, all but clocks and memory: the same however it was split or stopped
    (every column the run writes, one a user adds to the row too)."""
    return [column for column in rows.columns if column not in CLOCKS]


def assert_same_epochs(folder: Path, reference: Path) -> None:
    """Every epoch exactly once, with the uninterrupted run's numbers (an epoch without evaluation: NaN in both)."""
    resumed, expected = pd.read_csv(folder / "pytorch_res.csv"), pd.read_csv(reference / "pytorch_res.csv")
    assert resumed["epoch"].tolist() == expected["epoch"].tolist() and numbers(resumed) == numbers(expected)
    for column in numbers(expected):
        assert resumed[column].tolist() == pytest.approx(expected[column].tolist(), rel=1e-5, nan_ok=True), column
    assert resumed["elapsed_seconds"].is_monotonic_increasing  # the clock goes on from the checkpoint's
    assert checkpoint_epoch(folder) == len(expected) and not list(folder.glob("*.tmp*"))
    ends = [
        torch.load(f / name, weights_only=True)
        for f in (folder, reference)
        for name in (files.BEST_NAME, "checkpoint.pt")
    ]
    assert ends[0]["epoch"] == ends[2]["epoch"] and ends[1]["scaler"] == ends[3]["scaler"]  # fp16's loss scale too


# ----------------------------------------------------------------------------- one normal run, read many ways


def test_two_ranks_write_one_row_per_epoch(reference_run):
    out, _ = reference_run
    df = pd.read_csv(out / "pytorch_res.csv")
    assert list(df.columns[:3]) == ["epoch", "loss", "acc"] and CLOCKS < set(df.columns)
    assert df["epoch"].tolist() == [1, 2, 3, 4, 5]
    assert (df["lr"] > 0).all() and (df["images_per_second"] > 0).all() and (df["peak_memory_mb"] > 0).all()
    assert df["elapsed_seconds"].is_monotonic_increasing and (df["write_wait_seconds"] >= 0).all()


def test_two_ranks_of_the_templates_resnet_learn(tmp_path):
    """With the template's own network (whatever make_model returns after a swap): the recipe learns, on images of
    CIFAR-10's size."""
    args = [*TINY, "--image_size=32", "--epochs=4", f"--output_dir={tmp_path}"]
    result = run_script(*args, env=clean_env(TEST_OWN_NETWORK="8"))
    assert result.returncode == 0, result.stderr
    df = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert df["acc"].iloc[-1] > 0.5, "10 classes: chance is 0.1"
    assert df["loss"].iloc[-1] < df["loss"].iloc[0] and df["train_acc"].iloc[-1] > 0.5


def test_only_rank_0_prints_a_first_line_a_line_per_epoch_and_a_done_line(reference_run):
    out, result = reference_run
    assert result.stderr == ""
    first, *epochs, done = lines(result.stdout)
    assert first.startswith(f"{model_name()}(") and "2 rank(s) on cpu (gloo)" in first
    assert "| global batch 48, 12 steps per epoch (24 images left out each), 5 epochs |" in first  # 600 = 12 x 48 + 24
    swapped = not isinstance(train_distribute.make_model(read_config(TINY), 10), ResNet)
    assert first.endswith(f"try {files.OTHER_NETWORKS}") == swapped, first  # the recipe's flags for another network
    assert [line.split()[:2] for line in epochs] == [["epoch", f"{e}/5"] for e in range(1, 6)]
    acc = pd.read_csv(out / "pytorch_res.csv")["acc"]
    best = max(range(1, 6), key=lambda epoch: (acc[epoch - 1], epoch))  # the later of equals
    assert done.startswith(f"done: 5 epochs; best acc {acc.max():.4f} (epoch {best}: best.pt), ") and str(out) in done
    assert f"final acc {acc.iloc[-1]:.4f}" in done and checkpoint_epoch(out, files.BEST_NAME) == best


def test_a_folder_with_train_only_trains_with_a_held_out_split_that_picks_the_best_epoch(tmp_path):
    """A folder of train/ alone is refused in one line naming HOLDOUT; with it, a share of each class is held out:
    the first line counts those images, the CSV has their val_acc and val_loss (no test split: no acc), and the best
    epoch, whose checkpoint best.pt holds, is the best val_acc's (the later of equals), as the last line says."""
    image_folder_of_noise(tmp_path / "images", train=240, test=0, size=16)
    args = [*TINY, "--dataset=imagefolder", f"--data_dir={tmp_path / 'images'}", "--image_size=16", "--num_workers=0"]
    args += ["--epochs=3", "--eval_every=1", f"--output_dir={tmp_path / 'out'}"]
    refused = run_script(*args, "--holdout=0")
    assert refused.returncode == 2 and lines(refused.stderr) == [
        f"error: DATA_DIR {tmp_path / 'images'} has no test/ folder; give a folder with train/<class>/ and "
        "test/<class>/, or hold out a share of train/ to evaluate on: --holdout 0.1"
    ]
    result = run_script(*args, "--holdout=0.25")
    assert result.returncode == 0, result.stderr
    first, *_, done = lines(result.stdout)
    assert "| 180 train, 60 held out images on imagefolder |" in first, first  # 30 of each class's 120
    rows = pd.read_csv(tmp_path / "out" / "pytorch_res.csv")
    assert {"val_acc", "val_loss"} <= set(rows.columns) and not {"acc", "test_loss"} & set(rows.columns)
    best = max(range(1, 4), key=lambda epoch: (rows["val_acc"][epoch - 1], epoch))
    assert done.startswith(f"done: 3 epochs; best val_acc {rows['val_acc'].max():.4f} (epoch {best}: best.pt), ")
    assert checkpoint_epoch(tmp_path / "out", files.BEST_NAME) == best


def test_a_picture_of_the_curves_and_a_plain_checkpoint(reference_run):
    out, _ = reference_run
    png = out / "pytorch_res.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)  # tensors and plain values
    assert set(checkpoint) == {
        "model",
        "optimizer",
        "history",
        "epoch",
        "config",
        "data",
        "precision",
        "scaler",
        "ranks",
    }
    assert checkpoint["ranks"] == 2 and checkpoint["config"]["WORLD_SIZE"] == 2  # TINY's: the ranks that trained it
    assert checkpoint["epoch"] == 5 and [row["epoch"] for row in checkpoint["history"]] == [1, 2, 3, 4, 5]
    assert not any(name.startswith(("module.", "_orig_mod.")) for name in checkpoint["model"])
    assert checkpoint["config"]["BATCH_SIZE"] == 48 and "state" in checkpoint["optimizer"]
    assert checkpoint["data"]["classes"] == [f"class_{c}" for c in range(10)] and len(checkpoint["data"]["mean"]) == 3


# ----------------------------------------------------------------------------- the world size changes nothing


def evaluate_checkpoint(world_size: int, answer: str, *argv: str) -> int:
    """Called in a process forked from the test server (conftest.call): `world_size` ranks, started by torch's elastic
    agent as a run's are, evaluate the checkpoint in OUTPUT_DIR; rank 0 writes the loss and accuracy to `answer`."""
    distribute_tools.run_distribute(_evaluate_rank, world_size, list(argv), answer)
    return 0


def _evaluate_rank(argv: list[str], answer: str) -> None:
    cfg = settings.read(train_distribute, argv)
    info = distribute_tools.setup(60)
    run = train_distribute.build_run(cfg, info)
    run.model.load_state_dict(files.load_checkpoint(cfg.OUTPUT_DIR)["model"])
    scores = train_distribute.evaluate(run)
    if info.is_main:
        Path(answer).write_text(json.dumps({"loss": scores["test_loss"], "acc": scores["acc"]}))
    distribute_tools.cleanup()


def test_evaluation_is_exact_and_independent_of_the_world_size(reference_run, tmp_path):
    """The same weights at world size 1 and 2: every test image exactly once either way, so the same accuracy; and
    the checkpoint holds what the run evaluated with, so its last accuracy comes back exactly."""
    out, _ = reference_run
    found = []
    for world_size in (1, 2):
        answer = tmp_path / f"ws{world_size}.json"
        options = {"call": f"{__name__}:evaluate_checkpoint", "cpus": ONE_CORE if world_size == 1 else None}
        run = launch(world_size, str(answer), *TINY, f"--output_dir={out}", **options)
        _, err = run.communicate(timeout=HANG_TIMEOUT)
        assert run.returncode == 0, err
        found.append(json.loads(answer.read_text()))
    assert found[0]["acc"] == found[1]["acc"] == pd.read_csv(out / "pytorch_res.csv")["acc"].iloc[-1]
    assert found[0]["loss"] == pytest.approx(found[1]["loss"], rel=1e-5)


class WithoutBatchNorm(nn.Module):
    """A small network whose output for an image does not depend on the other images of its batch (no BatchNorm):
    how a batch is split over ranks and micro-batches then cannot change a step beyond float rounding."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(16 * 4, num_classes)

    def forward(self, x):
        return self.head(nn.functional.adaptive_avg_pool2d(self.features(x), 2).flatten(1))


def train_without_batchnorm(*argv: str) -> int:
    """Called in a process forked from the test server: `python train_distribute.py *argv` with make_model swapped
    for a network without BatchNorm (README's "another network"); its ranks are forked from here and inherit it."""
    train_distribute.make_model = lambda cfg, num_classes: WithoutBatchNorm(num_classes)
    return train_distribute.main(list(argv), entrypoint=train_distribute.main)


@pytest.fixture(scope="module")
def without_batchnorm(reference_run, tmp_path_factory) -> dict[str, Path]:
    """The same run without BatchNorm and without randomness between ranks, both at once: on 1 rank and on 2; their
    output folders. The run on 1 rank writes into a copy of the reference run's folder,
    which also holds a previous-<time>/ folder of the name that moving those results aside would take."""
    tmp = tmp_path_factory.mktemp("without-batchnorm")
    shutil.copytree(reference_run[0], tmp / "1 rank")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((tmp / "1 rank" / "pytorch_res.csv").stat().st_mtime))
    (tmp / "1 rank" / f"previous-{stamp}").mkdir()
    (tmp / "1 rank" / f"previous-{stamp}" / "pytorch_res.csv").write_text("an even earlier run's")
    common = [*TINY, "--image_size=32", "--epochs=2", "--augment=False", "--precision=fp32", "--lr=4"]  # rounding: 1e-5
    variants = {"1 rank": ["--world_size=1"], "2 ranks": [], "2 ranks, 2 micro-batches": ["--accumulate=2"]}
    runs = {
        name: launch(
            *common,
            *extra,
            f"--output_dir={tmp / name}",
            call=f"{__name__}:train_without_batchnorm",
            cpus=ONE_CORE if name == "1 rank" else None,
        )
        for name, extra in variants.items()
    }
    for name, run in runs.items():
        out, err = run.communicate(timeout=HANG_TIMEOUT)
        assert run.returncode == 0 and err == "", f"{name}: {err}"
        (tmp / name / "stdout").write_text(out)
    return {name: tmp / name for name in variants}


def assert_same_numbers(run: Path, reference: Path) -> None:
    run_rows, reference_rows = pd.read_csv(run / "pytorch_res.csv"), pd.read_csv(reference / "pytorch_res.csv")
    assert reference_rows["acc"].iloc[-1] > 0.5, "a run that learns nothing would compare equal whatever it stepped"
    for column in numbers(reference_rows):
        expected = reference_rows[column].tolist()
        assert run_rows[column].tolist() == pytest.approx(expected, rel=SPLIT_ROUNDING, nan_ok=True), column


def test_a_network_that_onednn_gets_wrong_in_bf16_on_cpus_is_found_and_the_templates_is_not():
    """oneDNN's bf16 weight gradient of a strided convolution with a 1x1 output holds memory it never wrote (on CPUs
    with bf16): such a network trains in fp32 there, as its first line says. The template's ResNet has none, down to
    the smallest IMAGE_SIZE."""
    strided = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1))
    assert start.cpu_bf16_faults(strided, 4) == ["2"] and start.cpu_bf16_faults(strided, 8) == []
    assert start.cpu_bf16_faults(ResNet(4), 8) == [] and strided.training


@pytest.mark.parametrize("capability, words", [((6, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_precision_is_fp16_with_loss_scaling_on_gpus_without_fast_bf16_and_muon_stays_fp32_there(
    monkeypatch, capability, words
):
    """PRECISION="auto" on a GPU: bf16 from compute capability 8.0 (Ampere) on; below it (P100, V100, T4, RTX 20xx)
    fp16 autocast with dynamic loss scaling, where Muon's orthogonalisation stays fp32 (bf16 is emulated there). A
    choice by hand is taken as it is."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    precision = start.precision(torch.device("cuda", 0), "auto", ResNet(4), 32)
    assert precision == {"fp16": "fp16 autocast, dynamic loss scaling", "bf16": "bf16 autocast"}[words]
    cfg = read_config(["--optimizer=muon"])
    banks = muon.make_optimizer(cfg, ResNet(16), 0.1, torch.device("cpu"), precision.startswith("bf16")).banks.padded
    assert (torch.bfloat16 in {bank.dtype for bank in banks}) == (words == "bf16")  # 128 rows and more: bf16
    for chosen in ("fp16", "fp32"):
        assert start.precision(torch.device("cuda", 0), chosen, ResNet(4), 32).startswith(chosen)
        assert start.precision(torch.device("cpu"), chosen, ResNet(4), 32).startswith(chosen)


def step_with_an_overflow(answers: str, *argv: str) -> int:
    """Called in a process forked from the test server (conftest.call): 2 ranks, started by torch's elastic agent as a
    run's are, take two training steps in fp16 (train_step); rank 1's gradients overflow in the first. Each rank saves
    what it saw into `answers`."""
    distribute_tools.run_distribute(_step_with_an_overflow, 2, list(argv), answers)
    return 0


def _step_with_an_overflow(argv: list[str], answers: str) -> None:
    cfg = settings.read(train_distribute, argv)
    info = distribute_tools.setup(60)
    run = train_distribute.build_run(cfg, info)
    x, y = next(iter(run.train_data.train_batches(cfg.BATCH_SIZE, 2, info.rank, cfg.SEED, 1)))
    before, sums = [p.detach().clone() for p in run.model.parameters()], torch.zeros(3)
    first = next(run.model.parameters())
    overflow = first.register_hook(lambda grad: torch.full_like(grad, math.inf) if info.rank == 1 else grad)
    train_distribute.train_step(run, x, y, 0.05, sums)
    seen = {"skipped": all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))}
    seen |= {"scale": run.scaler.get_scale(), "precision": run.precision}
    overflow.remove()
    train_distribute.train_step(run, x, y, 0.05, sums)
    seen |= {"before": before, "weights": [p.detach() for p in run.model.parameters()]}
    seen["banks"] = [str(bank.dtype) for bank in run.optimizer.banks.padded]
    torch.save(seen, Path(answers) / f"rank{info.rank}.pt")
    distribute_tools.cleanup()


def test_an_fp16_step_whose_gradients_overflow_on_one_rank_is_skipped_on_every_rank_alike(tmp_path):
    """PRECISION=fp16 (CPU fp16 autocast and GradScaler("cpu"), the GPU's choice below compute capability 8.0): rank
    1's gradients overflow; averaged over the ranks, every rank's are inf, and every rank skips the step and halves its
    loss scale. The next step trains, and the ranks' weights stay equal. Muon's banks (128 rows: bf16 where the run
    is) are fp32."""
    argv = [*TINY, "--precision=fp16", "--optimizer=muon", *width(16), "--output_dir=unused"]
    result = call(f"{__name__}:step_with_an_overflow", str(tmp_path), *argv)
    assert result.returncode == 0, result.stderr
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    for seen in ranks:
        assert seen["skipped"] and seen["scale"] == 2.0**15 and seen["precision"].startswith("fp16 autocast")
        assert seen["banks"] and set(seen["banks"]) == {"torch.float32"}
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[0]["before"], strict=True))


def test_two_ranks_step_like_one_rank_on_the_whole_batch(without_batchnorm):
    """Sharding and gradient averaging: each step of 24 images on each of 2 ranks is the step of the same 48 images
    on 1 rank, so the runs' losses and accuracies agree (float rounding: the sums run in another order); the LR
    follows the global batch, not the world size."""
    assert_same_numbers(without_batchnorm["2 ranks"], without_batchnorm["1 rank"])


def test_micro_batches_step_like_the_whole_batch(without_batchnorm):
    """ACCUMULATE=2: each rank's 24 images in two passes of 12, the gradients all-reduced once, in the second."""
    assert (
        "global batch 48 in 2 micro-batches, 12 steps per epoch"
        in lines((without_batchnorm["2 ranks, 2 micro-batches"] / "stdout").read_text())[0]
    )
    assert_same_numbers(without_batchnorm["2 ranks, 2 micro-batches"], without_batchnorm["2 ranks"])


def test_world_size_1_follows_the_same_lr_and_moves_old_results_aside_never_overwriting_them(
    without_batchnorm, reference_run
):
    """The LR follows the global batch (BATCH_SIZE), not the world size. A new run moves the earlier run's files to
    previous-<time>/, under another name where one of that time exists."""
    folder, out = without_batchnorm["1 rank"], reference_run[0]
    stdout = (folder / "stdout").read_text()
    assert "1 rank(s) on cpu (gloo)" in stdout
    lr = [pd.read_csv(without_batchnorm[name] / "pytorch_res.csv")["lr"].tolist() for name in ("1 rank", "2 ranks")]
    assert lr[0] == lr[1] and len(lr[0]) == 2
    (earlier,) = [p for p in folder.glob("previous-*") if (p / "checkpoint.pt").exists()]
    (even_earlier,) = [p for p in folder.glob("previous-*") if p != earlier]
    assert earlier.name.startswith(f"{even_earlier.name}-")  # the same time: another name, nothing overwritten
    assert (even_earlier / "pytorch_res.csv").read_text() == "an even earlier run's"
    assert f"moved the earlier run's results in {folder} to {earlier}" in stdout
    for name in files.RESULT_FILES:  # best.pt too
        assert (earlier / name).read_bytes() == (out / name).read_bytes(), name
    assert csv_rows(folder) == 2


# ----------------------------------------------------------------------------- kill -9, Ctrl-C, and resume


def wait_for_marker(marker: Path, run) -> None:
    """Until the hooked writer says that the slow epoch's files are being written (TEST_SLOW_EPOCH, TEST_MARKER)."""
    deadline = time.monotonic() + HANG_TIMEOUT
    while not marker.exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.02)


def killed_and_resumed() -> SimpleNamespace:
    """A run killed with SIGKILL, launcher and ranks at once, while epoch 3's files are written in the background
    (epoch 2 is in the CSV), and what it left; then the same run resumed, and while the resumed run writes epoch 4's
    files, a second run into its folder (at the tests' priority: it must come in those 2 s). A scenario."""
    tmp = Path(tempfile.mkdtemp(prefix="killed-"))
    folder, pids = tmp / "out", tmp / "pids"
    pids.mkdir()
    env = clean_env(TEST_SLOW_EPOCH="3", TEST_MARKER=str(tmp / "writing-3"), TEST_PIDS=str(pids))
    killed = launch(*REFERENCE, f"--output_dir={folder}", env=env, nice=BACKGROUND)
    wait_for_marker(tmp / "writing-3", killed)
    kill_9(killed, pids)
    png = (folder / "pytorch_res.png").read_bytes()
    left = {"epoch": checkpoint_epoch(folder), "rows": csv_rows(folder), "png_whole": png[-8:-4] == b"IEND"}
    env = clean_env(TEST_SLOW_EPOCH="4", TEST_MARKER=str(tmp / "writing-4"))
    resumed = launch(f"--output_dir={folder}", "--resume=True", env=env, nice=BACKGROUND)  # the checkpoint has the rest
    wait_for_marker(tmp / "writing-4", resumed)
    second = run_script(*TINY, "--epochs=1", "--seed=1", f"--output_dir={folder}")
    out, err = resumed.communicate(timeout=HANG_TIMEOUT)
    return SimpleNamespace(
        folder=folder, left=left, resumed=subprocess.CompletedProcess([], resumed.returncode, out, err), second=second
    )


@pytest.fixture
def killed_then_resumed() -> SimpleNamespace:
    return scenario(killed_and_resumed)


@needs((killed_and_resumed,))
def test_kill_9_during_a_background_write_loses_only_that_epoch(killed_then_resumed):
    assert killed_then_resumed.left == {"epoch": 2, "rows": 2, "png_whole": True}  # epoch 2's files, whole


@needs((killed_and_resumed,))
def test_kill_9_then_resume_gives_every_epoch_once_and_the_same_numbers(killed_then_resumed, reference_run):
    folder, result = killed_then_resumed.folder, killed_then_resumed.resumed
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "resuming after epoch 2 of 5" in result.stdout and "done: 5 epochs" in result.stdout
    assert "epoch 1/5" not in result.stdout and "epoch 2/5" not in result.stdout
    assert_same_epochs(folder, reference_run[0])
    assert not list(folder.glob("previous-*")), "the resumed run moved its own results aside"


GRAD_NORM = 'run.step_sums["grad_norm_t"] += torch.nn.utils.clip_grad_norm_(run.model.parameters(), math.inf)'


def stopped_with_dropout(loader: str) -> SimpleNamespace:
    """A network with dropout on its input (TEST_DROPOUT) trained without a stop, and the same run stopped by SIGTERM
    during epoch 2's files and resumed: a scenario, in the background. "memory": a copy of the script with README's
    one edit in train_step (GRAD_NORM, before the optimizer step). Streamed, the runs decode in the rank (no fork
    server) until the resume, which has a worker per reader: workers change no number. "fp16": the memory loader's
    run in fp16 autocast, its loss scaled (the scaler's state is in the checkpoint)."""
    tmp = Path(tempfile.mkdtemp(prefix="dropout-"))
    args = [*SHORT, "--precision=fp16"] if loader == "fp16" else [*SHORT, "--precision=auto"]
    args = [*tiny_stream_args(), "--epochs=4"] if loader == "stream" else args
    edited, copy = {"call": "tests.hooked_run:edited_copy"} if loader == "memory" else {}, tmp / "train_distribute.py"
    if edited:  # the copy's path first: edited_copy's argument
        step = "    run.scaler.step(run.optimizer)\n"
        copy.write_text(SCRIPT.read_text().replace(step, f"    {GRAD_NORM}\n{step}", 1))
        args = [str(copy), *args]
    alone, stopped = tmp / "alone", tmp / "stopped"
    env = clean_env(TEST_DROPOUT="0.3", TEST_STREAM="1" if loader == "stream" else "")  # tiny_stream fits in memory
    uninterrupted = launch(*args, f"--output_dir={alone}", env=env, nice=BACKGROUND, **edited)
    env_stopped = {**env, "TEST_SLOW_EPOCH": "2", "TEST_MARKER": str(tmp / "m")}
    run = launch(*args, f"--output_dir={stopped}", env=env_stopped, nice=BACKGROUND, **edited)
    wait_for_marker(tmp / "m", run)  # epoch 1 is in the CSV, epoch 2's files are being written
    os.kill(run.pid, signal.SIGTERM)
    code, kept = run.wait(HANG_TIMEOUT), checkpoint_epoch(stopped)
    first = lines(uninterrupted.communicate(timeout=HANG_TIMEOUT)[0])[0]
    workers = ["--num_workers=1"] if loader == "stream" else []
    resumed = launch(*args, *workers, f"--output_dir={stopped}", "--resume=True", env=env, nice=BACKGROUND, **edited)
    resumed_out, resumed_err = resumed.communicate(timeout=HANG_TIMEOUT)
    return SimpleNamespace(
        code=code, kept=kept, alone=alone, stopped=stopped, first=first, uninterrupted=uninterrupted.returncode,
        resumed=resumed.returncode, resumed_err=resumed_err, resumed_out=resumed_out,
        edited=copy.read_text() if edited else "",
    )  # fmt: skip


stopped_with_dropout.long = True  # (conftest.pytest_collection_finish)


@needs((stopped_with_dropout, "memory"), (stopped_with_dropout, "stream"), (stopped_with_dropout, "fp16"))
@pytest.mark.parametrize("loader", ["memory", "stream", "fp16"])
def test_a_network_with_dropout_stopped_by_sigterm_and_resumed_gives_the_same_numbers(loader):
    """Randomness in the network's forward (here dropout on its input) continues after a resume as if the run had
    not stopped: on the memory loader, and on the stream loader, resumed with worker processes."""
    done = scenario(stopped_with_dropout, loader)
    assert done.code == 75 and done.kept < 4
    assert done.uninterrupted == 0 and done.first.endswith(
        f"| muon's LR was tuned for resnet.py's ResNet: for another network try {files.OTHER_NETWORKS}"
    ), done.first  # the network is a Sequential now
    assert done.resumed == 0, done.resumed_err
    assert ("| loader stream, 1 worker(s) per rank |" in done.resumed_out) == (loader == "stream"), done.resumed_out
    assert ("| fp16 autocast, dynamic loss scaling |" in done.first) == (loader == "fp16"), done.first
    assert_same_epochs(done.stopped, done.alone)


@needs((stopped_with_dropout, "memory"))
def test_a_value_of_each_step_is_a_csv_column_with_one_edit_and_a_resume_gives_the_same_values():
    """README's table: `run.step_sums["name"] += value` in train_step adds the column `name`, the mean of the value over
    the epoch's steps on every rank (here the gradient norm, the same on every rank), exact after a resume."""
    done = scenario(stopped_with_dropout, "memory")
    assert done.edited.count(GRAD_NORM) == 1 and done.code == 75 and done.resumed == 0, done.resumed_err
    norms = pd.read_csv(done.alone / files.CSV_NAME)["grad_norm_t"]  # a name of the test's own, beside a user's
    assert len(norms) == 5 and norms.between(1e-3, 1e3).all() and norms.nunique() == 5, norms
    resumed = pd.read_csv(done.stopped / files.CSV_NAME)["grad_norm_t"]
    assert resumed.tolist() == pytest.approx(norms.tolist(), rel=1e-5)


@needs((killed_and_resumed,))
def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line_and_the_first_finishes_unharmed(
    killed_then_resumed, reference_run
):
    folder, second = killed_then_resumed.folder, killed_then_resumed.second
    assert second.returncode == 2 and second.stdout == "", second.stdout
    assert lines(second.stderr) == [
        f"error: OUTPUT_DIR {folder} is in use by another run; wait for it or choose another"
    ]
    assert killed_then_resumed.resumed.returncode == 0
    assert_same_epochs(folder, reference_run[0])  # the first run's files, as if no other run had come
    assert not list(folder.glob("previous-*")), "the second run moved the first one's files"


def test_ctrl_c_during_a_background_write_finishes_the_files_first(tmp_path):
    folder, marker = tmp_path / "out", tmp_path / "writing"
    env = clean_env(TEST_SLOW_EPOCH="2", TEST_MARKER=str(marker))
    run = launch(*SHORT, f"--output_dir={folder}", env=env)
    wait_for_marker(marker, run)
    os.kill(run.pid, signal.SIGINT)  # to the launcher, which passes it on to the ranks
    _, err = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 130, err
    assert lines(err) == [f"interrupted: the files in {folder} are from epoch 2: continue with --resume True"]
    assert checkpoint_epoch(folder) == 2 and csv_rows(folder) == 2 and not list(folder.glob("*.tmp*"))
    assert (folder / "pytorch_res.png").stat().st_size > 10_000


@pytest.mark.parametrize("how", ["resume", "restart"])
def test_a_finished_run_started_again_changes_nothing_and_exits_0(reference_run, tmp_path, how):
    """--resume True, or a restart with the same settings (a requeued SLURM job): one line, nothing changed."""
    out, _ = reference_run
    folder = tmp_path / "out"
    shutil.copytree(out, folder)
    before = snapshot(folder)
    if how == "resume":
        result = run_script(*REFERENCE, f"--output_dir={folder}", "--resume=True")
    else:
        result = run_script(*REFERENCE, f"--output_dir={folder}", env=clean_env(SLURM_RESTART_COUNT="1"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert lines(result.stdout) == [f"already finished: all 5 epochs are in {folder}; nothing to do"]
    assert snapshot(folder) == before


# ----------------------------------------------------------------------------- failures: one line, last files kept


def test_a_failed_write_ends_the_run_in_one_line_naming_the_fix_and_the_kept_epoch(tmp_path):
    folder = tmp_path / "out"
    result = run_script(*SHORT, f"--output_dir={folder}", env=clean_env(TEST_FAIL_EPOCH="2"))
    assert result.returncode == 2, result.stderr
    assert lines(result.stderr) == [
        f"error: could not write {folder}/checkpoint.pt (No space left on device); free space, then continue with "
        f"--resume True (the checkpoint of epoch 1 is kept), or copy {folder}/checkpoint.pt into another --output_dir "
        "and resume there"
    ]
    assert checkpoint_epoch(folder) == 1 and csv_rows(folder) == 1 and (folder / "pytorch_res.png").exists()


def test_a_non_finite_loss_stops_every_rank_in_one_line_and_keeps_the_last_good_checkpoint(reference_run, tmp_path):
    folder = tmp_path / "out"
    checkpoint = copy_stopped_after(reference_run[0], folder, epoch=2)
    weights = next(t for t in checkpoint["model"].values() if t.is_floating_point())
    weights[(0,) * weights.dim()] = math.nan  # weights gone bad: epoch 3 cannot have a finite loss
    torch.save(checkpoint, folder / "checkpoint.pt")
    saved = (folder / "checkpoint.pt").read_bytes()
    result = run_script(*REFERENCE, f"--output_dir={folder}", "--resume=True")
    assert result.returncode == 2, result.stderr
    assert lines(result.stderr) == [
        f"error: the training loss became nan in epoch 3; lower --lr ({checkpoint['config']['LR']}); the files in "
        f"{folder} are from epoch 2: continue with --resume True"
    ]
    assert (folder / "checkpoint.pt").read_bytes() == saved and csv_rows(folder) == 2


def tensorboard_steps(folder: Path) -> dict[str, list[int]]:
    """The epochs of each curve in the TensorBoard event files of `folder`, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_resume_goes_on_with_the_checkpoints_settings_and_extends_and_tensorboard_follows(reference_run, tmp_path):
    """`--output_dir X --resume True --epochs 7` and nothing else: the finished run goes on with the checkpoint's
    settings (TINY's, none the block's) up to epoch 7, the schedule recomputed over 7 epochs, with TensorBoard's
    curves from then on; `--epochs 8` extends it again on 3 ranks (48 splits; the block's 512 would not), the curves
    continued, a line saying the numbers change with the ranks; a new run moves every file aside. It
    evaluates every 4th epoch from then on (EVAL_EVERY, free on resume), and always the last: epoch 6 is not, 7 and 8
    are, and the last line's final accuracy is the last epoch's."""
    folder = tmp_path / "out"
    shutil.copytree(reference_run[0], folder)
    extended = run_script(f"--output_dir={folder}", "--resume", "--epochs=7", "--tensorboard=True", "--eval_every=4")
    assert extended.returncode == 0 and extended.stderr == "", extended.stderr
    resuming, taken, how = lines(extended.stdout)[:3]
    assert resuming == "resuming after epoch 5 of 7"
    assert taken.startswith("the checkpoint's settings, not the block's: DATASET='synthetic', SYNTHETIC_SIZE=600")
    assert how == (
        "extended from 5 to 7 epochs: the schedule is recomputed over 7, so the numbers differ from those of a run "
        "started with --epochs 7"
    )
    rows, reference = pd.read_csv(folder / "pytorch_res.csv"), pd.read_csv(reference_run[0] / "pytorch_res.csv")
    assert rows["epoch"].tolist() == list(range(1, 8))
    pd.testing.assert_frame_equal(rows[numbers(reference)][:5], reference[numbers(reference)])  # epochs 1-5 as were
    steps, peak = 600 // 48, train_distribute.peak_lr(read_config(REFERENCE))  # epoch 6's last step, of 7 epochs'
    assert rows["lr"].iloc[5] == pytest.approx(train_distribute.lr_at(6 * steps - 1, 7 * steps, peak, "onecycle", 0.2))
    assert set(map(tuple, tensorboard_steps(folder).values())) == {(6, 7)}
    assert rows[["acc", "test_loss"]].iloc[5].isna().all() and rows[["acc", "test_loss"]].iloc[6].notna().all()
    assert lines(extended.stdout)[-1].startswith(f"done: 7 epochs; best acc {rows['acc'].max():.4f} (epoch ")
    assert f"final acc {rows['acc'].iloc[6]:.4f}; results in " in lines(extended.stdout)[-1]
    again = run_script(f"--output_dir={folder}", "--resume", "--epochs=8", "--world_size=3")  # the block's 512: no
    assert again.returncode == 0 and csv_rows(folder) == 8, again.stderr
    assert "2 ranks trained it, 3 go on: the numbers differ from those of a run that never stopped" in again.stdout
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["ranks"] == 3  # as many as trained it last
    evaluated = pd.read_csv(folder / "pytorch_res.csv")["acc"].notna().tolist()
    assert evaluated == [*reference["acc"].notna(), False, True, True]  # the first 5 as the block's EVAL_EVERY had it
    assert tensorboard_steps(folder)["acc"] == [6, 7, 8]  # TENSORBOARD=True is the checkpoint's now
    new = run_script(*TINY, "--epochs=1", f"--output_dir={folder}")
    assert new.returncode == 0, new.stderr
    (earlier,) = folder.glob("previous-*")
    assert tensorboard_steps(earlier)["loss"] == [6, 7, 8] and not list(folder.glob("events.*"))


def test_a_resume_with_changed_settings_is_refused_in_one_line(reference_run, tmp_path):
    folder = tmp_path / "out"
    copy_stopped_after(reference_run[0], folder, epoch=2)
    before = results(folder)
    result = run_script(*REFERENCE, "--lr=0.1", f"--output_dir={folder}", "--resume=True")
    assert result.returncode == 2 and result.stdout == ""
    assert lines(result.stderr) == [
        f"error: RESUME=True: LR=0.1 differs from the checkpoint's {read_config(REFERENCE).LR} in {folder}; "
        "resume without --lr, or start a new run in another --output_dir"
    ]
    assert results(folder) == before


def test_a_resume_with_another_network_is_refused_in_one_line_saying_what_differs(reference_run, tmp_path):
    """make_model builds another network now (here the ResNet at width 4, not 8): its tensors' shapes differ."""
    folder = tmp_path / "out"
    copy_stopped_after(reference_run[0], folder, epoch=2)
    before = results(folder)
    result = run_script(f"--output_dir={folder}", "--resume", env=clean_env(TEST_OWN_NETWORK="4"))
    (line,) = lines(result.stderr)  # the only line: no "resuming", no first line before it
    assert (
        result.returncode == 2
        and result.stdout == ""
        and line.startswith(f"error: the checkpoint in {folder} is of another network (")
    ), line
    assert "of make_model's 62 tensors not in it by name and shape (first stem.0.weight [4, 3, 3, 3]), " in line
    assert " unknown (first " in line and line.endswith(
        "); resume with the network that wrote it, or start a new run in another --output_dir"
    )
    assert results(folder) == before


@pytest.mark.parametrize("wider", [False, True])
def test_fine_tuning_from_a_checkpoint_that_fits_less_than_half_the_parameters_is_refused_in_one_line(tmp_path, wider):
    """A checkpoint with no name of the network's; or the same network at width 16 for 8, of the same classes: every
    name, and in the same shape only the head's bias (10 of 150,802 parameters). Nothing is said first."""
    if wider and not width(16):
        pytest.skip("the network has no WIDTH setting to double")
    other = tmp_path / "other.pt"
    weights = train_distribute.make_model(read_config([*TINY, *width(16)]), 10) if wider else nn.Linear(3, 2)
    torch.save({"model": weights.state_dict()}, other)
    result = run_script(*TINY, f"--init_from={other}", f"--output_dir={tmp_path / 'out'}")
    name, first = next(iter(train_distribute.make_model(read_config(TINY), 10).named_parameters()))
    fits = "10 of the network's 150,802" if wider else "0 of the network's "
    mismatch = (
        "stem.0.weight: [16, 3, 3, 3] in it, [8, 3, 3, 3]" if wider else f"{name}: not in it, {list(first.shape)}"
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout
    (line,) = lines(result.stderr)
    assert line.startswith(f"error: INIT_FROM {other} fits {fits}") and line.endswith(
        f" parameters (first mismatch {mismatch} in the network); give a checkpoint of this network (the same layers "
        "and widths; the head may differ)"
    ), line


def test_a_resume_on_other_images_of_the_same_count_and_classes_is_refused(tmp_path):
    """An image folder is known by its files' names, classes and byte sizes: one file grown by a byte is other data.
    The refusal is the run's only line: no "resuming", no first line before it."""
    images, folder = tmp_path / "images", tmp_path / "out"
    image_folder_of_noise(images, train=16, test=4, size=8)
    args = ["--dataset=imagefolder", f"--data_dir={images}", "--image_size=8", *width(4), "--batch_size=8"]
    args += ["--num_workers=0"]
    first = run_script(*args, "--epochs=2", f"--output_dir={folder}")
    assert first.returncode == 0, first.stderr
    cut_back(folder, epoch=1)
    before = results(folder)
    from data import folder_digest, list_folder

    changed, was = (
        images / "train" / "a" / "0000.png",
        torch.load(folder / "checkpoint.pt", weights_only=True)["data"]["identity"],
    )
    listed = [*list_folder(str(images), "train")[1], *list_folder(str(images), "test")[1]]
    digest = folder_digest(str(images), listed)
    changed.write_bytes(changed.read_bytes() + b"\0")  # still an image, of another size in bytes
    now = was.replace(digest, folder_digest(str(images), listed))
    assert digest in was and now != was
    second = run_script(*args, "--epochs=2", f"--output_dir={folder}", "--resume=True")
    assert (second.returncode, second.stdout) == (2, "") and second.stderr == (
        f"error: the checkpoint in {folder} was trained on other data ({was}, now {now}); resume on the same data, or "
        "start a new run without --resume\n"
    )
    assert results(folder) == before
