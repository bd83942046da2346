import pytest
import torch

from resnet import ResNet

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
