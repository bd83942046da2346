"""The optimizers: Muon on the convolution filters with Nesterov SGD on the rest (the default), SGD, Adam (the seed's).
Muon takes each filter bank's momentum as a matrix (out_channels x the rest) and replaces it by the nearest matrix
whose singular values are all about 1 (Newton-Schulz iterations): every direction of the update moves about as much,
however unequal the gradient's. Our own: torch.optim.Muon (torch 2.9 on) takes only 2-D parameters."""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The quintic Newton-Schulz iteration's coefficients, chosen (by Muon's authors) to push every singular value of a
# matrix scaled to norm 1 towards 1 in five steps.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
STEPS = 5
BF16_FROM = 128  # bf16 products pay off from this short side on; below it fp32 is faster (a CPU with AMX, 1 core)


def newton_schulz(x: torch.Tensor) -> torch.Tensor:
    """About U V^T of each matrix U S V^T of a batch (count, rows, columns), rows <= columns, in x's dtype."""
    a, b, c = NEWTON_SCHULZ
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + 1e-7)
    for _ in range(STEPS):  # x <- a x + (b G + c G G) x with G = x x^T, in three products
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class MuonSGD(torch.optim.Optimizer):
    """Nesterov momentum and SGD's L2 decay for every parameter; 4-D ones' (filters') steps orthogonalised, scaled to
    the shape, `muon_scale` x the LR. `bf16`: larger banks in bf16, as Muon's authors do (3x fp32's speed on a CPU)."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, muon_scale: float, bf16: bool) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "muon_scale": muon_scale}
        super().__init__(params, defaults)
        self.dtype, self.made = torch.bfloat16 if bf16 else torch.float32, {}  # made: the filters' batches
        self.state.update({p: {"momentum_buffer": torch.zeros_like(p)} for g in self.param_groups for p in g["params"]})

    @torch.no_grad()
    def step(self, closure=None):
        # SGD's Nesterov updates, L2 weight decay included, and then every parameter's step, in a few foreach kernels
        # however many parameters (at width 8 on one CPU core: 1.1 ms a step, against 1.6 ms with five per parameter)
        params, updates, sizes = [], [], []
        for group in self.param_groups:
            group_params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in group_params]
            if decay := group["weight_decay"]:
                grads = torch._foreach_add(grads, group_params, alpha=decay)
            buffers = [self.state[p]["momentum_buffer"] for p in group_params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, grads)
            params += group_params
            updates += torch._foreach_add(grads, buffers, alpha=group["momentum"])
            lr, filter_lr = group["lr"], group["lr"] * group["muon_scale"]  # filters: as a square's steps, if tall
            sizes += [-filter_lr * max(1, len(p) / p[0].numel()) ** 0.5 if p.ndim == 4 else -lr for p in group_params]
        filters = [i for i, p in enumerate(params) if p.ndim == 4]
        orthogonalised = iter(orthogonalise_shared([updates[i] for i in filters], self.dtype, self.made))
        updates = [next(orthogonalised) if p.ndim == 4 else u for u, p in zip(updates, params, strict=True)]
        torch._foreach_mul_(updates, sizes)
        torch._foreach_add_(params, updates)


def orthogonalise_shared(updates: list[torch.Tensor], dtype: torch.dtype, made: dict) -> list[torch.Tensor]:
    """Each update orthogonalised as a matrix (rows x the rest), several at once, zero-padded in 3-D tensors made once
    (in `made`): zero rows and columns stay zero in Newton-Schulz and change neither the norm nor the Gram products.
    A GPU's step is bound by launches (20 a batch), a CPU's by products: banks of one short side share a batch, and a
    smaller bank joins if it adds at most 1% (width 64: 12 banks in 3 batches; 18% more multiply-adds, 1% of a CPU
    step). In a process group each rank does its share (dealt by cost, dearest first) into one flat tensor, zero
    elsewhere, and one all-reduce sums the shares (the updates, DDP's averages, are alike on every rank)."""
    grouped = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    wide = [tuple(sorted((len(u), u[0].numel()))) for u in updates]  # each as a matrix, its short side first
    cost = [2 * rows * rows * columns + rows**3 for rows, columns in wide]  # multiply-adds of an iteration
    mine = sorted(range(len(wide)), key=lambda i: -cost[i])[rank::world_size]
    spare, batches = sum(cost[i] for i in mine) / 100, []  # 1% of this rank's products
    for i in sorted(mine, key=lambda i: wide[i], reverse=True):  # by short side, then long side
        rows, columns = wide[batches[-1][0]] if batches else (0, 0)
        extra = 0 if wide[i][0] == rows else 2 * rows * rows * columns + rows**3 - cost[i]
        if batches and wide[i][1] <= columns and extra <= spare:
            batches[-1].append(i)
        else:
            batches.append([i])

    def as_update(padded: torch.Tensor, i: int) -> torch.Tensor:  # bank i's corner of a padded matrix, as update i
        matrix = padded[: wide[i][0], : wide[i][1]]
        return (matrix if wide[i][0] == len(updates[i]) else matrix.T).view(updates[i].shape)

    results = {}  # each of this rank's banks: its result
    for banks in batches:  # made at the first step: the padding stays zero
        if (key := tuple(wide[i] for i in banks)) not in made:
            kind = dtype if key[0][0] >= BF16_FROM else torch.float32
            made[key] = torch.zeros(len(key), *key[0], dtype=kind, device=updates[0].device)
        torch._foreach_copy_([as_update(made[key][j], i) for j, i in enumerate(banks)], [updates[i] for i in banks])
        out = newton_schulz(made[key]).float()
        results |= {i: as_update(out[j], i) for j, i in enumerate(banks)}
    if world_size > 1:
        sizes = [u.numel() for u in updates]
        if (key := ("flat", sum(sizes))) not in made:
            made[key] = torch.zeros(sum(sizes), device=updates[0].device)
        pieces = [as_update(piece.view(wide[i]), i) for i, piece in enumerate(made[key].zero_().split(sizes))]
        torch._foreach_copy_([pieces[i] for i in results], list(results.values())) if results else None
        dist.all_reduce(made[key])
        return pieces
    return [results[i] for i in range(len(updates))]


def make_optimizer(cfg: Any, model: nn.Module, lr: float, device: torch.device, bf16: bool) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere; Muon: MuonSGD above."""
    if cfg.OPTIMIZER == "muon":
        return MuonSGD(model.parameters(), lr, cfg.MOMENTUM, cfg.WEIGHT_DECAY, cfg.MUON_SCALE, bf16)
    options: dict[str, Any] = {"lr": lr, "weight_decay": cfg.WEIGHT_DECAY}
    options["fused" if device.type == "cuda" else "foreach"] = True
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)
