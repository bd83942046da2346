"""The ResNet itself: the only tests that read its settings (WIDTH, RELU_AFTER_SUM) and its layers. A project
that swaps in another network deletes this file, and the rest of the suite still passes (tests/swap_network.py)."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from resnet import ResNet
from tests.conftest import TINY, call, run_script

SEED_NETWORK_PARAMETERS = 9_553_674  # the seed's resnet.py, counted with torch


def conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k + cout  # weights + bias


def bn(c: int) -> int:
    return 2 * c  # scale and shift per channel


def block(cin: int, cout: int) -> int:
    shortcut = conv(cin, cout, 1) + bn(cout) if cin != cout else 0
    return conv(cin, cout, 3) + bn(cout) + conv(cout, cout, 3) + bn(cout) + shortcut


def expected_parameters(w: int, classes: int = 10) -> int:
    """The architecture's count from its description."""
    return (
        conv(3, w, 3)
        + bn(w)
        + block(w, 2 * w)
        + block(2 * w, 4 * w)
        + block(4 * w, 8 * w)
        + block(8 * w, 8 * w)
        + 8 * w * classes
        + classes
    )


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_default_is_the_seed_network():
    assert count(ResNet()) == SEED_NETWORK_PARAMETERS == expected_parameters(64)


@pytest.mark.parametrize("width", [8, 16, 32])
def test_width_scales_every_layer(width):
    model = ResNet(width)
    assert count(model) == expected_parameters(width)
    assert model.stem[0].out_channels == width
    assert model.head.in_features == 8 * width


@pytest.mark.parametrize("width,classes", [(8, 10), (16, 7)])
def test_output_shape(width, classes):
    model = ResNet(width, num_classes=classes).eval()
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, classes)
    assert count(ResNet(width, classes)) == expected_parameters(width, classes)


def test_relu_after_the_sum_or_the_seeds_plain_sum():
    """The seed adds the two paths without a ReLU, so its blocks can output negative values."""
    x = torch.randn(4, 8, 16, 16)
    seed_block, standard_block = ResNet(8, relu_after_sum=False).blocks[0], ResNet(8).blocks[0]
    standard_block.load_state_dict(seed_block.state_dict())
    seed_out, standard_out = seed_block.eval()(x), standard_block.eval()(x)
    assert (seed_out < 0).any() and (standard_out >= 0).all()
    torch.testing.assert_close(standard_out, seed_out.clamp(min=0))
    assert count(ResNet(64, relu_after_sum=False)) == count(ResNet(64)) == SEED_NETWORK_PARAMETERS


def test_rejects_zero_width():
    with pytest.raises(ValueError):
        ResNet(0)


# ----------------------------------------------------------------------------- in the training script


@pytest.mark.parametrize(
    "world_size,widths,settings",
    [
        (2, range(1, 9), ["--batch_size=32", "--synthetic_size=160"]),
        (4, range(1, 9), ["--batch_size=64", "--synthetic_size=320"]),
        (1, [8], ["--batch_size=1", "--synthetic_size=8", "--amp=True"]),
        *[(2, [8], ["--batch_size=2", "--synthetic_size=8", f"--amp={amp}"]) for amp in (False, True)],
        *[
            (2, [8], ["--batch_size=4", "--synthetic_size=32", f"--image_size={size}", f"--amp={amp}"])
            for size in (64, 96)
            for amp in (False, True)
        ],
    ],
)
def test_no_width_or_batch_crashes_a_rank(tmp_path, world_size, widths, settings):
    """oneDNN's weight gradient of a strided 1x1 convolution with at most 8 input channels in channels_last corrupts
    the heap on AVX-512 CPUs without AMX (docs/cpu-kinds.md): widths 1-8 in every case below crashed a rank there,
    as did one image per rank in bf16 and width 8 at 64 and 96 pixels."""
    out = str(tmp_path / "widths.json")
    assert call("tests.workers:start", "widths_worker", world_size, list(widths), settings, out).returncode == 0
    assert json.loads(Path(out).read_text()) == list(widths)


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


def test_width_0_is_one_line_before_anything_starts(tmp_path):
    result = run_script(*TINY, "--width=0", f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().startswith("error: make_model cannot build the network (ValueError: width and ")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
