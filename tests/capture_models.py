"""Small models in the styles capture must handle: in-place ReLUs on residual sums, writes to
views of received values, eager mixture-of-experts routing, dropout and stochastic depth."""

from __future__ import annotations

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
