"""Small models in the styles capture must handle: in-place ReLUs on residual sums, writes to
views of received values, eager mixture-of-experts routing, dropout and stochastic depth."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


class InplaceBlock(nn.Module):
    """conv-BN, residual add, then an in-place ReLU on the sum (torchvision's BasicBlock)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


class InplaceResNet(nn.Module):
    def __init__(self, width: int = 4, blocks: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.blocks = nn.Sequential(*[InplaceBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.relu(self.stem(x)))
        return self.head(x.mean((2, 3)))


class _ScaleHalf(nn.Module):
    """Doubles the first half of the features in place through a slice (a view)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        a[:, : a.shape[1] // 2].mul_(2.0)
        return self.lin(a)


class ViewWrite(nn.Module):
    """layers.1 writes into a view of layers.0's output; `reuse` reads that output again later."""

    def __init__(self, dim: int = 6, reuse: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim), _ScaleHalf(dim), nn.Linear(dim, dim)])
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.layers[0](x)
        b = self.layers[1](a)
        c = self.layers[2](b)
        return c + a if self.reuse else c


class _PermutedGroupNorm(nn.Module):
    """GroupNorm on a channels-last activation permuted to channels-first (not contiguous)."""

    def __init__(self, channels: int):
        super().__init__()
        self.lin = nn.Linear(channels, channels)
        self.norm = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, h, w, channels)
        y = self.norm(self.lin(x).permute(0, 3, 1, 2))
        return y.permute(0, 2, 3, 1)


class PermutedGroupNormNet(nn.Module):
    def __init__(self, channels: int = 8, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([_PermutedGroupNorm(channels) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class EagerMoE(nn.Module):
    """Top-2 routing the common eager way: `nonzero()` per expert, a loop over the experts hit,
    `index_add_` of the weighted expert outputs. Data-dependent: torch.export cannot trace it."""

    def __init__(self, dim: int, experts: int = 4, top: int = 2):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList([_Expert(dim) for _ in range(experts)])
        self.top = top

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        weights, chosen = torch.topk(F.softmax(logits, dim=-1), self.top, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        hit = torch.zeros(len(self.experts), dtype=torch.bool)
        hit[chosen.flatten()] = True
        for e in hit.nonzero().flatten().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](tokens[rows]) * weights[rows, slot].unsqueeze(-1)
            out = out.index_add(0, rows, y)
        return out.reshape(shape), logits


class _MoEBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.moe_norm = nn.LayerNorm(dim)
        self.moe = EagerMoE(dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.attn(self.norm(x))
        x = x + h.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).unsqueeze(-1)
        y, logits = self.moe(self.moe_norm(x))
        return x + y, logits


class MoEDecoder(nn.Module):
    """A small decoder whose blocks each hold an eager MoE; returns (logits, router aux loss)."""

    def __init__(self, vocab: int = 32, dim: int = 8, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([_MoEBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, logits = block(x)
            aux = aux + logits.logsumexp(-1).pow(2).mean()
        return self.head(x), aux


class DataDependentRoot(nn.Module):
    """The root's own forward branches on a tensor value: nothing to keep opaque."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if x.sum() > 0:
            x = x * 2
        return x


class _DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (timm's drop_path)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep


class _NoisyBlock(nn.Module):
    def __init__(self, dim: int, p: float, drop_path: float):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.drop_path = _DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.drop(torch.tanh(self.fc(x))))


class NoisyMLP(nn.Module):
    """Residual MLP blocks with dropout and stochastic depth (random in training mode)."""

    def __init__(self, dim: int = 6, layers: int = 4, p: float = 0.3, drop_path: float = 0.25):
        super().__init__()
        self.blocks = nn.ModuleList([_NoisyBlock(dim, p, drop_path) for _ in range(layers)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# -- MaxViT's block and grid attention (torchvision's partition reshapes), small ---------------


class _MBConv(nn.Module):
    """Inverted bottleneck with a strided depthwise conv: halves the image."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.expand = nn.Conv2d(cin, 2 * cout, 1)
        self.depthwise = nn.Conv2d(2 * cout, 2 * cout, 3, stride=2, padding=1, groups=2 * cout)
        self.project = nn.Conv2d(2 * cout, cout, 1)
        self.skip = nn.Sequential(nn.AvgPool2d(3, 2, 1), nn.Conv2d(cin, cout, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.project(F.gelu(self.depthwise(self.expand(self.norm(x)))))


def _partition(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p windows, p * p, C), torchvision's WindowPartition."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p, c)


def _departition(x: torch.Tensor, p: int, hp: int, wp: int) -> torch.Tensor:
    """The inverse of `_partition` (torchvision's WindowDepartition)."""
    b, _, _, c = x.shape
    x = x.reshape(b, hp, wp, p, p, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, hp * p, wp * p)


class _PartitionAttention(nn.Module):
    """Attention within p x p windows (block) or across a p x p grid of windows (grid: the
    partition's two middle dims swapped), then an MLP, as MaxViT's PartitionAttentionLayer."""

    def __init__(self, dim: int, p: int, grid: bool):
        super().__init__()
        self.p, self.grid = p, grid
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                 nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        p = h // self.p if self.grid else self.p
        x = _partition(x, p)
        if self.grid:
            x = x.transpose(-2, -3)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(torch.softmax(q @ k.transpose(-1, -2) / c ** 0.5, dim=-1) @ v)
        x = x + self.mlp(x)
        if self.grid:
            x = x.transpose(-2, -3)
        return _departition(x, p, h // p, w // p)


class TinyMaxVit(nn.Module):
    """Stem, then per stage an MBConv, block attention and grid attention (MaxViT's layout).
    With every input size symbolic, torch.export spends minutes in sympy on the partition
    reshapes of even one stage; with the batch alone symbolic, seconds."""

    def __init__(self, dims: tuple[int, ...] = (8, 8), p: int = 2, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 3, 2, 1), nn.GELU())
        self.stages = nn.ModuleList([
            nn.Sequential(_MBConv(a, b), _PartitionAttention(b, p, grid=False),
                          _PartitionAttention(b, p, grid=True))
            for a, b in zip(dims[:-1], dims[1:])])
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


# -- a custom autograd.Function: reversible residual layers -------------------------------------


class Reversible(torch.autograd.Function):
    """y1 = x1 + f(x2), y2 = x2 + g(y1) (RevNet, Reformer): the forward keeps no activations
    (it runs under no_grad), the backward recomputes the inputs from the outputs."""

    @staticmethod
    def forward(ctx, x, f, g, *params):  # type: ignore[override]
        x1, x2 = x.chunk(2, dim=-1)
        with torch.no_grad():
            y1 = x1 + f(x2)
            y = torch.cat([y1, x2 + g(y1)], dim=-1)
        ctx.f, ctx.g = f, g
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        f, g = ctx.f, ctx.g
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = g(y1)
            dg = torch.autograd.grad(gy1, [y1, *g.parameters()], dy2)
        dy1 = dy1 + dg[0]
        with torch.enable_grad():
            x2 = (y2 - gy1).detach().requires_grad_()
            fx2 = f(x2)
            df = torch.autograd.grad(fx2, [x2, *f.parameters()], dy1)
        return (torch.cat([dy1, dy2 + df[0]], dim=-1), None, None, *df[1:], *dg[1:])


class RevBlock(nn.Module):
    def __init__(self, half: int):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(half, half), nn.Tanh())
        self.g = nn.Sequential(nn.Linear(half, half), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Reversible.apply(x, self.f, self.g, *self.f.parameters(), *self.g.parameters())


class RevNet(nn.Module):
    """A projection, reversible blocks, a head. `in_root` applies one more Reversible in the
    root's own forward (nothing there can be kept opaque)."""

    def __init__(self, half: int = 4, layers: int = 4, in_root: bool = False):
        super().__init__()
        self.inp = nn.Linear(3, 2 * half)
        self.blocks = nn.ModuleList([RevBlock(half) for _ in range(layers)])
        self.out = nn.Linear(2 * half, 2)
        self.extra = RevBlock(half) if in_root else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        if self.extra is not None:
            f, g = self.extra.f, self.extra.g
            x = Reversible.apply(x, f, g, *f.parameters(), *g.parameters())
        return self.out(x)


# -- an in-place write to a parameter through .data ---------------------------------------------


class _ClampedLinear(nn.Linear):
    """Keeps its weight in [-0.3, 0.3] by clamping `.data` in place in train mode (torch.export
    refuses the write, and names no frame of the model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.weight.data.clamp_(-0.3, 0.3)
        return super().forward(x)


class ClampedNet(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = _ClampedLinear(dim, dim)
        self.c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def returns_tuple(forward):
    """A decorator shared by many modules' forwards, living in another file than the model (as
    transformers' `can_return_tuple`): every decorated forward runs through this one line."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper
