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
    if gram_pays(*x.shape[1:], x.dtype):
        return gram_newton_schulz(x)
    for _ in range(STEPS):  # x <- a x + (b G + c G G) x with G = x x^T, in three products
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_pays(rows: int, columns: int, dtype: torch.dtype) -> bool:
    """The Gram form's products (2 rows^2 columns + 20 rows^3) are fewer: fp32 matrices wider than about 2:1."""
    return dtype == torch.float32 and 8 * columns > 15 * rows


def gram_newton_schulz(x: torch.Tensor) -> torch.Tensor:
    """The same iteration as x_k = q_k x with q_k a rows x rows polynomial in G = x x^T (symmetric, commuting with G):
    G_k = q_k G q_k^T, q_k+1 = a q_k + (b G_k + c G_k G_k) q_k. 4 rows^3 multiply-adds a step instead of 2 rows^2
    columns + rows^3: 2.5x fewer in all for a 3x3 filter bank of equal channels. bf16 would lose G's small values."""
    a, b, c = NEWTON_SCHULZ
    gram = torch.bmm(x, x.mT)
    q = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # the first step, from q_0 = I
    q.diagonal(dim1=1, dim2=2).add_(a)
    for _ in range(STEPS - 1):
        gram_k = torch.bmm(torch.bmm(q, gram), q.mT)
        q = torch.baddbmm(q, torch.baddbmm(gram_k, gram_k, gram_k, beta=b, alpha=c), q, beta=a)
    return torch.bmm(q, x)


class MuonSGD(torch.optim.Optimizer):
    """Nesterov momentum and SGD's L2 decay for every parameter; 4-D ones' (filters') steps orthogonalised, scaled to
    the shape, `muon_scale` x the LR. `bf16`: larger banks in bf16, as Muon's authors do (3x fp32's speed on a CPU).
    Graph-safe: its buffers are made here, and a group's LR may be a device tensor that the training loop fills."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, muon_scale: float, bf16: bool) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "muon_scale": muon_scale}
        super().__init__(params, defaults)
        for group in self.param_groups:  # the LR in a device tensor, which the training loop fills
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32, device=group["params"][0].device)
        every = [p for group in self.param_groups for p in group["params"]]
        self.state.update({p: {"momentum_buffer": torch.zeros_like(p)} for p in every})
        self.dtype, self.banks = torch.bfloat16 if bf16 else torch.float32, {}  # banks: FilterBanks by filters
        self.filter_banks([p for p in every if p.ndim == 4])

    def filter_banks(self, filters: list[torch.Tensor]) -> "FilterBanks":
        if (key := tuple(map(id, filters))) not in self.banks:  # all filters, made above; another set if some froze
            self.banks[key] = FilterBanks(filters, self.dtype)
        return self.banks[key]

    @torch.no_grad()
    def step(self, closure=None):
        # SGD's Nesterov updates, L2 weight decay included, and then every parameter's step, in a few foreach kernels
        # however many parameters (at width 8 on one CPU core: 1.1 ms a step, against 1.6 ms with five per parameter)
        params, updates, scales, lrs = [], [], [], []
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
            filter_scale = group["muon_scale"]  # filters: as a square's steps, if tall
            scales += [
                -filter_scale * max(1, len(p) / p[0].numel()) ** 0.5 if p.ndim == 4 else -1.0 for p in group_params
            ]
            lrs.append((group["lr"], len(group_params)))
        filters = [i for i, p in enumerate(params) if p.ndim == 4]
        banks = self.filter_banks([params[i] for i in filters])
        orthogonalised = iter(banks.orthogonalise([updates[i] for i in filters]))
        updates = [next(orthogonalised) if p.ndim == 4 else u for u, p in zip(updates, params, strict=True)]
        torch._foreach_mul_(updates, scales)  # all dense, in the parameters' layout: one multi-tensor kernel on CUDA
        start = 0
        for lr, count in lrs:  # a number, or a device tensor
            torch._foreach_mul_(updates[start : start + count], lr)
            start += count
        torch._foreach_add_(params, updates)


class FilterBanks:
    """Filter updates orthogonalised as matrices (rows x the rest), several at once, zero-padded in 3-D tensors made
    here: zero rows and columns stay zero in Newton-Schulz and change neither the norm nor the Gram products. A GPU's
    step is bound by launches (20 a batch), a CPU's by products: banks of one short side share a batch, and a smaller
    bank joins if it adds at most 1% (width 64: 12 banks in 3 batches; 18% more multiply-adds, 1% of a CPU step). In a
    process group each rank does its share (by cost, dearest first, each to the least-loaded rank) into one flat
    tensor, zero elsewhere, and one all-reduce sums the shares (the updates, DDP's averages, are alike on every rank).
    The results are that flat tensor's pieces, each dense in its filter's layout."""

    def __init__(self, filters: list[torch.Tensor], dtype: torch.dtype) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        self.shapes = [f.shape for f in filters]
        self.wide = wide = [tuple(sorted((len(f), f[0].numel()))) for f in filters]  # as matrices, short side first
        self.dtype = dtype
        cost = [self.products(*shape) for shape in wide]
        load, mine = [0] * self.world_size, []
        for i in sorted(range(len(wide)), key=lambda i: -cost[i]):  # dearest first, each to the least-loaded rank
            least = load.index(min(load))
            load[least] += cost[i]
            mine += [i] if least == rank else []
        spare, self.batches = load[rank] / 100, []  # 1% of this rank's products
        for i in sorted(mine, key=lambda i: wide[i], reverse=True):  # by short side, then long side
            rows, columns = wide[self.batches[-1][0]] if self.batches else (0, 0)
            extra = 0 if wide[i][0] == rows else self.products(rows, columns) - cost[i]
            if self.batches and wide[i][1] <= columns and extra <= spare:
                self.batches[-1].append(i)
            else:
                self.batches.append([i])
        device = filters[0].device if filters else None
        self.padded = [
            torch.zeros(len(b), *wide[b[0]], dtype=self.kind(wide[b[0]][0]), device=device) for b in self.batches
        ]
        sizes = [f.numel() for f in filters]
        self.flat = torch.zeros(sum(sizes), device=device)
        self.results = [
            piece.as_strided(f.shape, f.stride()) for piece, f in zip(self.flat.split(sizes), filters, strict=True)
        ]

    def kind(self, rows: int) -> torch.dtype:
        return self.dtype if rows >= BF16_FROM else torch.float32

    def products(self, rows: int, columns: int) -> int:
        """Multiply-adds of newton_schulz on one matrix."""
        if gram_pays(rows, columns, self.kind(rows)):
            return 2 * rows * rows * columns + 4 * STEPS * rows**3
        return STEPS * (2 * rows * rows * columns + rows**3)

    def as_update(self, padded: torch.Tensor, i: int) -> torch.Tensor:
        """Bank i's corner of a padded matrix, as a view of update i's shape."""
        matrix = padded[: self.wide[i][0], : self.wide[i][1]]
        return (matrix if self.wide[i][0] == self.shapes[i][0] else matrix.T).view(self.shapes[i])

    def orthogonalise(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        self.flat.zero_() if self.world_size > 1 else None  # other ranks' shares: zero here
        outputs, results = [], []
        for banks, padded in zip(self.batches, self.padded, strict=True):
            torch._foreach_copy_(
                [self.as_update(padded[j], i) for j, i in enumerate(banks)], [updates[i] for i in banks]
            )
            out = newton_schulz(padded)
            outputs += [self.as_update(out[j], i) for j, i in enumerate(banks)]
            results += [self.results[i] for i in banks]
        torch._foreach_copy_(results, outputs) if results else None  # into the filters' layout, as fp32
        dist.all_reduce(self.flat) if self.world_size > 1 else None
        return self.results


def make_optimizer(cfg: Any, model: nn.Module, lr: float, device: torch.device, bf16: bool) -> torch.optim.Optimizer:
    """One fused kernel per step on GPUs, foreach (a few batched kernels) elsewhere; Muon: MuonSGD above."""
    if cfg.OPTIMIZER == "muon":
        return MuonSGD(model.parameters(), lr, cfg.MOMENTUM, cfg.WEIGHT_DECAY, cfg.MUON_SCALE, bf16)
    options: dict[str, Any] = {"lr": lr, "weight_decay": cfg.WEIGHT_DECAY}
    options["fused" if device.type == "cuda" else "foreach"] = True
    if cfg.OPTIMIZER == "adam":
        return torch.optim.Adam(model.parameters(), **options)
    return torch.optim.SGD(model.parameters(), momentum=cfg.MOMENTUM, nesterov=True, **options)
