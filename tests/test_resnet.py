"""The ResNet itself: the only tests that read its setting (WIDTH) and its layers. Once make_model returns another
network (README's swap, tests/swap_network.py) they skip, and the rest of the suite still passes."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from resnet import ResNet
from tests.conftest import TEMPLATE_ONLY, TINY, run_script

pytestmark = TEMPLATE_ONLY

SEED_NETWORK_PARAMETERS = 9_553_674  # the seed's resnet.py, counted with torch


def conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k  # weights; no bias: the BatchNorm after each convolution has one


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


def test_the_default_is_the_seed_network_without_the_biases_that_batchnorm_removes():
    with torch.device("meta"):  # counted without allocating 9.6 M parameters
        assert count(ResNet(seed=True)) == SEED_NETWORK_PARAMETERS
        biases = sum(m.out_channels for m in ResNet().modules() if isinstance(m, torch.nn.Conv2d))
        assert count(ResNet()) == expected_parameters(64) == SEED_NETWORK_PARAMETERS - biases


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


@pytest.mark.parametrize("width, classes", [(0, 10), (8, 0)])
def test_rejects_an_empty_network(width, classes):
    with pytest.raises(ValueError, match="must be positive"):
        ResNet(width, num_classes=classes)


def test_the_shortcut_is_the_seeds_strided_1x1_convolution_and_trains_in_channels_last():
    """The projection takes every stride-th pixel, then a 1x1 conv with stride 1: the seed's strided 1x1 conv as a
    function, gradients included (compared in float64), without the oneDNN kernel whose channels_last weight gradient
    corrupts the heap at up to 8 input channels on x86 CPUs (docs/cpu-kinds.md). Width 4: the first two blocks'
    shortcuts have 4 and 8 inputs; then trained in channels_last, as a run trains it."""
    torch.manual_seed(0)
    for block in ResNet(4).double().blocks[:2]:
        (conv, norm), x = block.shortcut, torch.randn(2, block.conv_1.in_channels, 16, 16, requires_grad=True).double()
        ours = block.shortcut(x[:, :, ::2, ::2])
        seed = norm(F.conv2d(x, conv.weight, conv.bias, stride=2))  # the seed's Conv2d(kernel_size=1, stride=2)
        assert conv.stride == (1, 1) and torch.allclose(ours, seed)
        grads = [torch.autograd.grad(y.square().sum(), [x, conv.weight]) for y in (ours, seed)]
        assert all(torch.allclose(a, b) for a, b in zip(*grads, strict=True))
    model = ResNet(4).to(memory_format=torch.channels_last)
    for _ in range(3):  # the kernel it avoids was wrong now and then, not every time
        model(torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)).square().sum().backward()


# ----------------------------------------------------------------------------- in the training script


def test_no_width_or_batch_crashes_a_rank(tmp_path):
    """What crashed a rank on AVX-512 CPUs without AMX (docs/cpu-kinds.md): every width up to 8, one image per rank
    in bf16, 64x64 images; here all at once, for an epoch and an evaluation."""
    settings = [
        "--width=8",
        "--batch_size=2",
        "--synthetic_size=8",
        "--image_size=64",
        "--precision=auto",
        "--epochs=1",
    ]
    result = run_script(*TINY, *settings, f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert len(pd.read_csv(tmp_path / "pytorch_res.csv")) == 1


def test_the_seed_recipe_runs_end_to_end(tmp_path):
    seed_recipe = ["--optimizer=adam", "--lr=1e-3", "--schedule=constant", "--weight_decay=0", "--label_smoothing=0",
                   "--augment=False", "--tta=False"]  # fmt: skip
    result = run_script(*TINY, *seed_recipe, "--epochs=2", f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ResNet(width=8, ") and " | adam | " in result.stdout.splitlines()[0]
    rows = pd.read_csv(tmp_path / "pytorch_res.csv")
    assert rows["lr"].tolist() == [1e-3] * 2
    assert rows["acc"].iloc[-1] > 0.3, "10 classes: chance is 0.1"


def test_width_0_is_one_line_before_anything_starts(tmp_path):
    result = run_script(*TINY, "--width=0", f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: WIDTH=0 on the command line is out of range: it must be at least 1")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
