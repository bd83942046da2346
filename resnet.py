"""The seed's ResNet for 32x32 images, with its channel count as a knob (width w = 64 is the seed's network): a 3x3 conv
stem (w channels), four blocks (w -> 2w -> 4w -> 8w -> 8w, the first two with stride 2: 32x32 -> 8x8), global average
pooling and a Linear head. Each block is two 3x3 conv + BN with a ReLU between them, plus a 1x1 conv + BN shortcut where
the channel count changes, and a ReLU on the sum (the seed's block returns the plain sum; the ReLU adds no parameters
and helps: +3.3 points in docs/accuracy.md). No bias in a convolution (the BatchNorm after it removes one in training),
no count of batches in BatchNorm (read only with momentum=None): two GPU kernels a layer fewer. seed=True keeps both:
9,553,674 parameters."""

import torch
from torch import nn
from torch.nn import functional as F


class ResBlock(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, stride: int, bias: bool) -> None:
        super().__init__()
        self.stride = stride
        self.conv_1 = nn.Conv2d(ch_in, ch_out, kernel_size=3, stride=stride, padding=1, bias=bias)
        self.bn_1 = nn.BatchNorm2d(ch_out)
        self.conv_2 = nn.Conv2d(ch_out, ch_out, kernel_size=3, stride=1, padding=1, bias=bias)
        self.bn_2 = nn.BatchNorm2d(ch_out)
        # A shortcut only where the channel count changes, as the seed's. Its strided 1x1 conv as every stride-th pixel
        # (a 1x1 average pool; a slice's gradient would come back contiguous), then stride 1: oneDNN's strided kernel
        # corrupts the heap in its channels_last weight gradient on x86 CPUs at up to 8 input channels (cpu-kinds.md).
        self.shortcut: nn.Module = nn.Identity()
        if ch_in != ch_out:  # built only where it is used, as the seed does
            self.shortcut = nn.Sequential(nn.Conv2d(ch_in, ch_out, kernel_size=1, bias=bias), nn.BatchNorm2d(ch_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = F.relu(self.bn_1(self.conv_1(x)))
        residual = self.bn_2(self.conv_2(residual))
        out = residual + self.shortcut(F.avg_pool2d(x, 1, self.stride) if self.stride > 1 else x)
        return F.relu(out)  # the seed's block returns `out`


class ResNet(nn.Module):
    def __init__(self, width: int = 64, num_classes: int = 10, seed: bool = False) -> None:
        super().__init__()
        if width < 1 or num_classes < 1:
            raise ValueError(f"width and num_classes must be positive, got {width} and {num_classes}")
        self.width = width  # the run's first line names it
        self.stem = nn.Sequential(nn.Conv2d(3, width, kernel_size=3, padding=1, bias=seed), nn.BatchNorm2d(width))
        self.blocks = nn.Sequential(
            ResBlock(width, 2 * width, 2, seed),
            ResBlock(2 * width, 4 * width, 2, seed),
            ResBlock(4 * width, 8 * width, 1, seed),
            ResBlock(8 * width, 8 * width, 1, seed),
        )
        self.head = nn.Linear(8 * width, num_classes)
        for norm in [m for m in self.modules() if isinstance(m, nn.BatchNorm2d)] if not seed else []:
            norm.num_batches_tracked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        x = F.avg_pool2d(x, x.shape[2:]).flatten(1)  # global average pool, channels_last in backward
        return self.head(x)
