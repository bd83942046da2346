"""The optimizers: Muon on the convolution filters with Nesterov SGD on the rest (the default), SGD, Adam (the seed's).
Muon replaces each filter bank's momentum (out_channels x the rest) by the nearest matrix whose singular values are all
about 1 (Newton-Schulz): every direction moves about as much. Ours: torch.optim.Muon (2.9 on) takes 2-D ones only."""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Muon's authors' coefficients of the quintic Newton-Schulz step: they take singular values in (0, 1] to about 1
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
STEPS = 5
BF16_FROM = 128  # bf16 products pay off from this short side on; below it fp32 is faster (a CPU with AMX, 1 core)


def newton_schulz(x: torch.Tensor) -> torch.Tensor:
    """About U V^T of each matrix U S V^T of a batch (count, rows, columns), rows <= columns, in x's dtype."""
    a, b, c = NEWTON_SCHULZ
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + 1e-7)
    if x.dtype == torch.float32 and 8 * x.size(2) > 15 * x.size(1):  # wider than about 2:1: fewer products
        return gram_newton_schulz(x)
    for _ in range(STEPS):  # x <- a x + (b G + c G G) x with G = x x^T, in three products
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_newton_schulz(x: torch.Tensor) -> torch.Tensor:
    """The same as x_k = q_k x, q_k a polynomial in G = x x^T: G_k = q_k G q_k^T, q_k+1 = a q_k + (b G_k + c G_k^2) q_k.
    2 rows^2 columns + 20 rows^3 multiply-adds, not 10 rows^2 columns + 5 rows^3 (fp32 only: bf16 loses small G)."""
    a, b, c = NEWTON_SCHULZ
    gram = torch.bmm(x, x.mT)
    q = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # the first step, from q_0 = I
    q.diagonal(dim1=1, dim2=2).add_(a)
    for _ in range(STEPS - 1):
        gram_k = torch.bmm(torch.bmm(q, gram), q.mT)
        q = torch.baddbmm(q, torch.baddbmm(gram_k, gram_k, gram_k, beta=b, alpha=c), q, beta=a)
    return torch.bmm(q, x)


class MuonSGD(torch.optim.Optimizer):
    """Nesterov momentum and SGD's L2 decay for one group of parameters; 4-D ones' (filters') steps orthogonalised,
    `muon_scale` x the LR; larger banks in bf16 if `bf16`. Graph-safe: buffers made here, the LR a device tensor."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, muon_scale: float, bf16: bool) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, muon_scale=muon_scale))
        (group,) = self.param_groups
        group["lr"] = torch.as_tensor(lr, dtype=torch.float32, device=group["params"][0].device)
        self.state.update({p: {"momentum_buffer": torch.zeros_like(p)} for p in group["params"]})
        self.filters = [p for p in group["params"] if p.ndim == 4]
        self.banks = FilterBanks(self.filters, torch.bfloat16 if bf16 else torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        # SGD's Nesterov updates (L2 decay included), then every parameter's step: a few foreach kernels in all
        (group,) = self.param_groups
        params = [p for p in group["params"] if p.grad is not None]  # not those frozen
        grads, buffers = [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params]
        if decay := group["weight_decay"]:  # the gradients become the updates, in place: no tensor made per step
            torch._foreach_add_(grads, params, alpha=decay)
        torch._foreach_mul_(buffers, group["momentum"])
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(grads, buffers, alpha=group["momentum"])
        by_param = dict(zip(params, grads, strict=True))
        filters = [by_param.get(p, self.state[p]["momentum_buffer"]) for p in self.filters]  # frozen: momentum, zero
        by_param |= dict(zip(self.filters, self.banks.orthogonalise(filters), strict=True))
        updates = [by_param[p] for p in params]  # all dense, in the parameters' layout: one CUDA kernel per foreach
        scale = [-group["muon_scale"] * max(1, len(p) / p[0].numel()) ** 0.5 for p in params]  # tall: as a square's
        torch._foreach_mul_(updates, [s if p.ndim == 4 else -1.0 for s, p in zip(scale, params, strict=True)])
        torch._foreach_mul_(updates, group["lr"])
        torch._foreach_add_(params, updates)


class FilterBanks:
    """Filter updates orthogonalised as matrices (rows x the rest), several at once, zero-padded in 3-D tensors made
    here (zero rows and columns stay zero in Newton-Schulz). GPUs count launches, CPUs products: banks of one short
    side share a batch, a smaller one joins if it adds at most 1%. Each rank does its share (dearest first, to the
    least-loaded) into a flat tensor, zero elsewhere, that one all-reduce sums: its pieces, in the filters' layouts."""

    def __init__(self, filters: list[torch.Tensor], dtype: torch.dtype) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        self.shapes = [f.shape for f in filters]
        self.wide = wide = [tuple(sorted((len(f), f[0].numel()))) for f in filters]  # as matrices, short side first
        cost = [2 * rows * rows * columns + rows**3 for rows, columns in wide]  # multiply-adds of an iteration
        load, mine = [0] * self.world_size, []
        for i in sorted(range(len(wide)), key=lambda i: -cost[i]):
            load[least := load.index(min(load))] += cost[i]
            mine += [i] if least == rank else []
        spare, self.batches = load[rank] / 100, []  # 1% of this rank's products
        for i in sorted(mine, key=lambda i: wide[i], reverse=True):  # by short side, then long side
            rows, columns = wide[self.batches[-1][0]] if self.batches else (0, 0)
            extra = 0 if wide[i][0] == rows else 2 * rows * rows * columns + rows**3 - cost[i]
            if self.batches and wide[i][1] <= columns and extra <= spare:
                self.batches[-1].append(i)
            else:
                self.batches.append([i])
        device = filters[0].device if filters else None
        sizes = [(len(banks), *wide[banks[0]]) for banks in self.batches]  # count, rows, columns
        self.padded = [torch.zeros(s, dtype=dtype if s[1] >= BF16_FROM else torch.float, device=device) for s in sizes]
        self.flat = torch.zeros(sum(f.numel() for f in filters), device=device)
        pieces = self.flat.split([f.numel() for f in filters])
        self.results = [piece.as_strided(f.shape, f.stride()) for piece, f in zip(pieces, filters, strict=True)]

    def as_update(self, padded: torch.Tensor, i: int) -> torch.Tensor:  # bank i's corner, in update i's shape
        matrix = padded[: self.wide[i][0], : self.wide[i][1]]
        return (matrix if self.wide[i][0] == self.shapes[i][0] else matrix.T).view(self.shapes[i])

    def orthogonalise(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        self.flat.zero_() if self.world_size > 1 else None  # other ranks' shares: zero here
        outputs, results = [], []
        for banks, padded in zip(self.batches, self.padded, strict=True):
            corners = [self.as_update(padded[j], i) for j, i in enumerate(banks)]
            torch._foreach_copy_(corners, [updates[i] for i in banks])
            out = newton_schulz(padded)
            outputs += [self.as_update(out[j], i) for j, i in enumerate(banks)]
            results += [self.results[i] for i in banks]
        torch._foreach_copy_(results, outputs) if results else None  # into the filters' layout, as fp32
        dist.all_reduce(self.flat) if self.world_size > 1 else None  # DDP: every rank meets: the shares, summed
        return self.results


def make_optimizer(cfg: Any, model: nn.Module, lr: float, device: torch.device, bf16: bool) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere; Muon: MuonSGD above."""
    if cfg.OPTIMIZER == "muon":
        return MuonSGD(model.parameters(), lr, cfg.MOMENTUM, cfg.WEIGHT_DECAY, cfg.MUON_SCALE, bf16)
    options = {"lr": lr, "weight_decay": cfg.WEIGHT_DECAY, "fused" if device.type == "cuda" else "foreach": True}
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)
