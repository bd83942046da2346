"""Does oneDNN's bf16 weight gradient of a convolution read memory it never wrote? For each shape, the same
convolution's weight gradient is computed 6 times in one process, with freed memory filled with other values in
between: a kernel that reads no uninitialised memory gives the same gradient every time.

    python -m benchmarks.bf16_strided_1x1              # bf16 autocast, channels_last
    python -m benchmarks.bf16_strided_1x1 --fp32       # the same shapes in fp32
    ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.bf16_strided_1x1   # another CPU kind's kernels

Prints the shapes whose gradient changed: (kernel, stride, input size, padding, depthwise or full, output size).
"""

import argparse
import itertools

import torch


def changes(conv: torch.nn.Conv2d, x: torch.Tensor, bf16: bool) -> bool:
    """Whether the weight gradient differs between tries, with freed memory refilled in between."""
    sums = set()
    for attempt in range(6):
        garbage = [torch.full((n,), attempt * 1e20 + 7.0) for n in (100, 1_000, 5_000, 20_000, 100_000)]
        del garbage  # freed: the next tensors may land where it was
        conv.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = conv(x)
        out.float().square().sum().backward()
        sums.add(conv.weight.grad.float().sum().item())
    return len(sums) > 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 autocast")
    args = parser.parse_args()
    torch.set_num_threads(1)
    found, tried = [], 0
    for kernel, stride, size, same, depthwise in itertools.product(
        (3, 5, 7), (1, 2, 3), (1, 2, 3, 5), *[(True, False)] * 2
    ):
        padding = kernel // 2 if same else 0
        if size + 2 * padding < kernel:
            continue
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(32, 32, kernel, stride, padding, groups=32 if depthwise else 1, bias=False)
        conv = conv.to(memory_format=torch.channels_last)
        x = torch.randn(8, 32, size, size).contiguous(memory_format=torch.channels_last)
        tried += 1
        if changes(conv, x, not args.fp32):
            output = (size + 2 * padding - kernel) // stride + 1
            found.append((kernel, stride, size, padding, "depthwise" if depthwise else "full", output))
    print(
        f"torch {torch.__version__}, {'fp32' if args.fp32 else 'bf16'}: {len(found)} of {tried} shapes changed: {found}"
    )


if __name__ == "__main__":
    main()
