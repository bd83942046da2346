"""Muon (muon.py): the orthogonalisation, the optimizer that applies it to the convolution filters only, and the
ranks' split of its work."""

from pathlib import Path

import pytest
import torch

import distribute_tools
import muon
from resnet import ResNet
from tests.conftest import call


def alone(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One matrix orthogonalised by itself, in `dtype`, as a batch of one (its short side first)."""
    tall = matrix.size(0) > matrix.size(1)
    result = muon.newton_schulz((matrix.T if tall else matrix).to(dtype)[None])[0].float()
    return result.T if tall else result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalise_makes_every_singular_value_about_one(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 144), (64, 32), (8, 8)):
        u, _, v = torch.linalg.svd(torch.randn(shape, generator=g), full_matrices=False)
        matrix = u @ torch.diag(torch.logspace(0, -1.3, min(shape))) @ v  # singular values from 1 to 0.05
        result = alone(matrix, dtype)
        values = torch.linalg.svdvals(result)
        assert result.dtype == torch.float32 and result.shape == matrix.shape
        assert values.min() > 0.5 and values.max() < 1.3, values  # Newton-Schulz's five steps: a band around 1
        inside = u.T @ result @ v.T  # in the matrix's own singular directions: diagonal, the directions kept
        assert (inside - torch.diag(inside.diagonal())).abs().max() < 0.05 and inside.diagonal().min() > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_banks_orthogonalised_together_equal_each_one_alone(dtype):
    """Banks of several shapes (wide, tall, 1x1, channels_last as in a run) share padded batches, made once and kept
    for the next step: the results equal each bank's alone, to fp32's rounding, or bf16's where batches run in bf16
    (a batch of short side 128 or more, which small banks may join)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(128, 16, 3, 3), (128, 32, 3, 3), (256, 128, 1, 1), (64, 8, 3, 3), (16, 3, 3, 3), (32, 16, 1, 1)]
    filters = [torch.empty(shape).contiguous(memory_format=torch.channels_last) for shape in shapes]
    banks = muon.FilterBanks(filters, dtype)
    for _ in range(2):  # the second step reuses the padded batches of the first
        updates = [torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last) for shape in shapes]
        together = banks.orthogonalise(updates)
        for update, result in zip(updates, together, strict=True):
            matrix = update.flatten(1)
            reference = alone(matrix, dtype if min(matrix.shape) >= muon.BF16_FROM else torch.float32)
            error = (result.flatten(1) - reference).abs().max() / reference.abs().max()
            assert result.shape == update.shape and error < (2e-2 if dtype == torch.bfloat16 else 1e-5), (
                update.shape,
                error,
            )
    assert len(banks.padded) < len(shapes)  # fewer batches than banks


def dense(t: torch.Tensor) -> bool:
    """Its strides tile its elements without a gap or an overlap (ATen's is_non_overlapping_and_dense)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda pair: pair[1]):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def test_the_final_step_takes_cudas_multi_tensor_path(monkeypatch):
    """CUDA's foreach kernels run as one launch only when every tensor is dense and non-overlapping, the lists share
    one dtype and device, and each update has its parameter's size and strides: else one kernel per tensor. Checked
    on the CPU for the last add of a step of the ResNet in channels_last, as a run trains it."""
    seen, original = [], torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: seen.append(a) or original(*a, **k))
    model = ResNet(4).to(memory_format=torch.channels_last)
    model(torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)).sum().backward()
    optimizer = muon.MuonSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, muon_scale=0.2, bf16=True)
    optimizer.step()
    params, updates = seen[-1][:2]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    tensors = [*params, *updates]
    assert len({(t.dtype, t.device) for t in tensors}) == 1
    assert all(dense(t) for t in tensors)
    assert [(u.shape, u.stride()) for u in updates] == [(p.shape, p.stride()) for p in params]


def test_filters_step_orthogonalised_and_the_rest_as_nesterov_sgd():
    g = torch.Generator().manual_seed(1)
    conv = torch.nn.Parameter(torch.randn(8, 4, 3, 3, generator=g))
    bias = torch.nn.Parameter(torch.randn(8, generator=g))
    twin = torch.nn.Parameter(bias.detach().clone())
    optimizer = muon.MuonSGD([conv, bias], lr=0.1, momentum=0.9, weight_decay=0.0, muon_scale=0.2, bf16=False)
    sgd = torch.optim.SGD([twin], lr=0.1, momentum=0.9, nesterov=True)
    before = conv.detach().clone()
    for _ in range(2):
        conv.grad, bias.grad = torch.randn(8, 4, 3, 3, generator=g), torch.randn(8, generator=g)
        twin.grad = bias.grad.clone()
        optimizer.step()
        sgd.step()
    assert torch.allclose(bias, twin, atol=1e-6)  # not a filter: plain Nesterov SGD
    values = torch.linalg.svdvals((conv - before).reshape(8, -1))
    assert values.max() / values.min() < 3  # every direction moved by about as much


def test_weight_decay_is_sgds_l2_penalty():
    g = torch.Generator().manual_seed(2)
    bias = torch.nn.Parameter(torch.randn(8, generator=g))
    twin = torch.nn.Parameter(bias.detach().clone())
    optimizer = muon.MuonSGD([bias], lr=0.1, momentum=0.9, weight_decay=5e-2, muon_scale=0.2, bf16=False)
    sgd = torch.optim.SGD([twin], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-2)
    for _ in range(3):
        bias.grad = torch.randn(8, generator=g)
        twin.grad = bias.grad.clone()
        optimizer.step()
        sgd.step()
    assert torch.allclose(bias, twin, atol=1e-6)


def muon_steps(seed: int = 0) -> list[torch.Tensor]:
    """Three Muon steps on filter banks of several shapes (wide, tall, 1x1) and a bias, from seeded gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (32, 8, 1, 1), (24, 16, 3, 3), (16,)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]
    optimizer = muon.MuonSGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4, muon_scale=0.2, bf16=False)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach() for p in params]


def muon_rank(out_dir: str) -> None:
    """One rank: Muon's steps in a process group, where each rank orthogonalises a share of the filter banks."""
    info = distribute_tools.setup(60)
    torch.save(muon_steps(), Path(out_dir, f"rank{info.rank}.pt"))
    distribute_tools.cleanup()


def muon_on_two_ranks(out_dir: str) -> int:
    """What the test runs (tests.conftest.call): muon_rank on 2 ranks, started as the launcher starts a run's."""
    distribute_tools.run_distribute(muon_rank, 2, out_dir)
    return 0


def test_ranks_split_the_orthogonalisation_and_end_with_the_same_weights_as_one_process(tmp_path):
    result = call("tests.test_muon:muon_on_two_ranks", str(tmp_path))
    assert result.returncode == 0, result.stderr
    alone = muon_steps()  # no process group: this process orthogonalises every filter bank itself
    for rank in (0, 1):
        shared = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for a, b in zip(shared, alone, strict=True):
            assert torch.allclose(a, b, atol=1e-5), rank
