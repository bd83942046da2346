"""Muon: the orthogonalisation, and the optimizer that applies it to the convolution filters only."""

import pytest
import torch

import muon
from tests.conftest import call
from tests.workers import muon_steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_orthogonalise_makes_every_singular_value_about_one(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in ((16, 144), (64, 32), (8, 8)):
        u, _, v = torch.linalg.svd(torch.randn(shape, generator=g), full_matrices=False)
        matrix = u @ torch.diag(torch.logspace(0, -1.3, min(shape))) @ v  # singular values from 1 to 0.05
        result = muon.orthogonalise(matrix, dtype)
        values = torch.linalg.svdvals(result)
        assert result.dtype == torch.float32 and result.shape == matrix.shape
        assert values.min() > 0.5 and values.max() < 1.3, values  # Newton-Schulz's five steps: a band around 1


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
    torch.testing.assert_close(bias, twin)  # not a filter: plain Nesterov SGD
    step = (conv - before).reshape(8, -1)
    values = torch.linalg.svdvals(step)
    assert values.max() / values.min() < 3  # every direction moved by about as much


def test_ranks_split_the_orthogonalisation_and_end_with_the_same_weights_as_one_process(tmp_path):
    assert call("tests.workers:start", "muon_worker", 2, str(tmp_path)).returncode == 0
    alone = muon_steps()  # no process group: this process orthogonalises every filter bank itself
    for rank in (0, 1):
        shared = torch.load(tmp_path / f"rank{rank}.pt")
        for a, b in zip(shared, alone, strict=True):
            torch.testing.assert_close(a, b)
