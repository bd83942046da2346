"""The optimizers: Muon for the convolution filters, Nesterov SGD for everything else, in one optimizer (the default),
or plain Nesterov SGD, or Adam (the seed's).

Muon (momentum, then orthogonalisation) takes each filter bank's momentum as a matrix (out_channels x the rest)
and replaces it by the nearest matrix whose singular values are all about 1, with a few Newton-Schulz iterations:
every direction of the update moves by about the same amount, however unequal the gradient's directions are.
Own implementation (torch.optim.Muon, torch 2.9 and newer, takes only 2-D parameters); it runs on torch 2.4 on.
The orthogonalisation costs about as much as a small forward pass; in a process group each rank does a share of
the filter banks and the ranks exchange the results, so the work is split rather than repeated on every rank."""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The quintic Newton-Schulz iteration's coefficients, chosen (by Muon's authors) to push every singular value of a
# matrix scaled to norm 1 towards 1 in five steps.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
STEPS = 5
BF16_FROM = 128  # bf16 products pay off from this short side on; below it fp32 is faster (a CPU with AMX, 1 core)


def orthogonalise(matrix: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of matrix = U S V^T, by five Newton-Schulz iterations computed in `dtype`."""
    a, b, c = NEWTON_SCHULZ
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x  # iterate on the smaller Gram matrix
    x = x / (x.norm() + 1e-7)
    for _ in range(STEPS):  # x <- a x + (b G + c G G) x with G = x x^T, in three products
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).contiguous().to(matrix.dtype)


class MuonSGD(torch.optim.Optimizer):
    """Nesterov momentum for every parameter; for 4-D ones (convolution filters) the step is orthogonalised and
    scaled to the shape, `muon_scale` times the group's learning rate. L2 weight decay as SGD adds it. With
    `bf16`, the orthogonalisation of the larger filter banks runs in bf16, as Muon's authors run it (3x faster
    than fp32 for width 64's filters on one core of a CPU with native bf16)."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, muon_scale: float, bf16: bool) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "muon_scale": muon_scale}
        super().__init__(params, defaults)
        self.dtype = torch.bfloat16 if bf16 else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        filters = []  # (parameter, Nesterov update, step size): orthogonalised together below
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            # SGD's Nesterov updates, L2 weight decay included, in a few foreach kernels for all the parameters
            # (measured at width 8 on one CPU core: 1.1 ms a step, against 1.6 ms with five kernels per parameter)
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, grads)
            updates = torch._foreach_add(grads, buffers, alpha=group["momentum"])
            rest = [(p, u) for p, u in zip(params, updates, strict=True) if p.ndim != 4]
            if rest:
                torch._foreach_add_([p for p, _ in rest], [u for _, u in rest], alpha=-group["lr"])
            lr = group["lr"] * group["muon_scale"]
            filters += [(p, u, lr) for p, u in zip(params, updates, strict=True) if p.ndim == 4]
        orthogonalised = orthogonalise_shared([u for _, u, _ in filters], self.dtype)
        for (p, _, lr), update in zip(filters, orthogonalised, strict=True):
            shape = max(1.0, len(p) / p[0].numel()) ** 0.5  # as a square matrix's steps, for tall ones
            p.add_(update.view_as(p), alpha=-lr * shape)


def orthogonalise_shared(updates: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each update orthogonalised as a matrix (rows x the rest). In a process group, each rank orthogonalises its
    share (dealt out by cost, the dearest first, like cards) into one flat tensor that is zero elsewhere, and one
    all-reduce sums the shares: every rank gets every result. The updates are the same on every rank (DDP averaged
    the gradients), and so are the weights after the step."""
    grouped = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    shapes = [sorted((len(u), u[0].numel())) for u in updates]
    dearest_first = sorted(range(len(updates)), key=lambda i: -(shapes[i][0] ** 2) * shapes[i][1])  # multiply-adds
    sizes = [u.numel() for u in updates]
    flat = torch.zeros(sum(sizes), device=updates[0].device if updates else None)
    pieces = flat.split(sizes)
    for i in dearest_first[rank::world_size]:  # this rank's share
        matrix = orthogonalise(updates[i].flatten(1), dtype if shapes[i][0] >= BF16_FROM else torch.float32)
        pieces[i].copy_(matrix.flatten())
    if world_size > 1:
        dist.all_reduce(flat)
    return [piece.view(len(u), -1) for piece, u in zip(pieces, updates, strict=True)]


def make_optimizer(cfg: Any, model: nn.Module, lr: float, device: torch.device, bf16: bool) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere; Muon: MuonSGD above."""
    if cfg.OPTIMIZER == "muon":
        return MuonSGD(model.parameters(), lr, cfg.MOMENTUM, cfg.WEIGHT_DECAY, cfg.MUON_SCALE, bf16)
    options: dict[str, Any] = {"lr": lr, "weight_decay": cfg.WEIGHT_DECAY}
    options["fused" if device.type == "cuda" else "foreach"] = True
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)
