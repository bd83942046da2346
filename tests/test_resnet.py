"""The ResNet itself: the only tests that read its settings (WIDTH, RELU_AFTER_SUM) and its layers. A project that
swaps in another network deletes this file, and the rest of the suite still passes (tests/swap_network.py)."""

import pandas as pd
import pytest
import torch

from resnet import ResNet
from safeguards import checks
from tests.conftest import TINY, run_script

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
    blocks = block(w, 2 * w) + block(2 * w, 4 * w) + block(4 * w, 8 * w) + block(8 * w, 8 * w)
    return conv(3, w, 3) + bn(w) + blocks + 8 * w * classes + classes


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_default_is_the_seed_network():
    with torch.device("meta"):  # counted without allocating 9.6 M parameters
        assert count(ResNet()) == SEED_NETWORK_PARAMETERS == expected_parameters(64)
        assert count(ResNet(64, relu_after_sum=False)) == SEED_NETWORK_PARAMETERS  # the ReLU adds no parameter


@pytest.mark.parametrize("width", [8, 16, 32])
def test_width_scales_every_layer(width):
    model = ResNet(width)
    assert count(model) == expected_parameters(width)
    assert model.stem[0].out_channels == width and model.head.in_features == 8 * width


@pytest.mark.parametrize("width, classes", [(8, 10), (16, 7)])
def test_output_shape(width, classes):
    model = ResNet(width, num_classes=classes).eval()
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, classes)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, classes)  # global pooling: any image size
    assert count(model) == expected_parameters(width, classes)


def test_relu_after_the_sum_or_the_seeds_plain_sum():
    """The seed adds the two paths without a ReLU, so its blocks can output negative values."""
    x = torch.randn(4, 8, 16, 16)
    seed_block, standard_block = ResNet(8, relu_after_sum=False).blocks[0], ResNet(8).blocks[0]
    standard_block.load_state_dict(seed_block.state_dict())
    seed_out, standard_out = seed_block.eval()(x), standard_block.eval()(x)
    assert (seed_out < 0).any() and (standard_out >= 0).all()
    assert torch.equal(standard_out, seed_out.clamp(min=0))


@pytest.mark.parametrize("width, classes", [(0, 10), (8, 0)])
def test_rejects_an_empty_network(width, classes):
    with pytest.raises(ValueError, match="must be positive"):
        ResNet(width, num_classes=classes)


def test_the_route_around_cpu_crashes_computes_the_same_network():
    """The strided 1x1 shortcuts with at most 8 input channels, whose channels_last weight gradient corrupts memory in
    oneDNN on x86 CPUs (docs/cpu-kinds.md), run with stride 1 on every stride-th pixel: the same outputs and gradients
    as the network without the route in the contiguous layout. (The unrouted network is never trained in channels_last
    here: its backward pass can corrupt this process's heap.)"""
    torch.manual_seed(0)
    routed, reference = ResNet(4), ResNet(4)  # width 4: the shortcuts of the first two blocks have 4 and 8 inputs
    reference.load_state_dict(routed.state_dict())
    checks.route_around_cpu_crashes(routed, torch.device("cpu"))
    strides = {
        name: (conv.in_channels, conv.stride) for name, conv in routed.named_modules() if conv._get_name() == "Conv2d"
    }
    assert strides["blocks.0.shortcut.0"] == (4, (1, 1)) and strides["blocks.1.shortcut.0"] == (8, (1, 1))
    assert strides["blocks.2.shortcut.0"] == (16, (1, 1)) and strides["blocks.0.conv_1"] == (4, (2, 2))  # as they were
    routed = routed.to(memory_format=torch.channels_last)
    for _ in range(3):  # the kernel it avoids was wrong now and then, not every time
        x = torch.randn(2, 3, 16, 16)
        outputs = [routed(x.contiguous(memory_format=torch.channels_last)), reference(x)]
        assert torch.allclose(outputs[0], outputs[1], atol=1e-4)
        for model, out in zip((routed, reference), outputs, strict=True):
            model.zero_grad()
            out.square().sum().backward()
        for (name, ours), theirs in zip(routed.named_parameters(), reference.parameters(), strict=True):
            assert torch.allclose(ours.grad, theirs.grad, atol=1e-3, rtol=1e-2), name


# ----------------------------------------------------------------------------- in the training script


def test_no_width_or_batch_crashes_a_rank(tmp_path):
    """What crashed a rank on AVX-512 CPUs without AMX (docs/cpu-kinds.md): every width up to 8, one image per rank
    in bf16, 64x64 images; here all at once, for an epoch and an evaluation."""
    settings = ["--width=8", "--batch_size=2", "--synthetic_size=8", "--image_size=64", "--amp=True", "--epochs=1"]
    result = run_script(*TINY, *settings, f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert len(pd.read_csv(tmp_path / "pytorch_res.csv")) == 1


def test_the_seed_recipe_runs_end_to_end(tmp_path):
    seed_recipe = ["--optimizer=adam", "--lr=1e-3", "--schedule=constant", "--weight_decay=0", "--label_smoothing=0",
                   "--augment=False", "--tta=False", "--relu_after_sum=False"]  # fmt: skip
    result = run_script(*TINY, *seed_recipe, "--epochs=2", f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ResNet(width=8, ") and " | adam | " in result.stdout.splitlines()[0]
    rows = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert rows["lr"].tolist() == [1e-3] * 2
    assert rows["acc"].iloc[-1] > 0.3, "10 classes: chance is 0.1"


def test_width_0_is_one_line_before_anything_starts(tmp_path):
    result = run_script(*TINY, "--width=0", f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: make_model cannot build the network (ValueError: width and num_classes ")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
