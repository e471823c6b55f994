"""Small reference models used by the examples, the tests and the benchmarks.

    GPT            decoder-only transformer (nanoGPT-style), optional tied embedding/LM head
    UNet           encoder/decoder CNN whose long skip connections cross many stages
    ResidualCNN    residual blocks with BatchNorm (buffers updated in training)
    KeywordTupleModel  a keyword input, a tuple output and one weight used at both ends
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "UNet", "ResidualCNN", "KeywordTupleModel", "lm_loss", "tuple_loss"]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = _MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT decoder: idx (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4,
                 seq: int = 64, tied: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:  # Embedding: none
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) token ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Three-level U-Net; enc1's output is read again by the last decoder (a long skip)."""

    def __init__(self, channels: int = 3, width: int = 8, classes: int = 2):
        super().__init__()
        self.enc1 = _conv(channels, width)
        self.enc2 = _conv(width, 2 * width)
        self.enc3 = _conv(2 * width, 4 * width)
        self.mid = _conv(4 * width, 4 * width)
        self.dec3 = _conv(8 * width, 2 * width)
        self.dec2 = _conv(4 * width, width)
        self.dec1 = _conv(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        m = self.mid(e3)
        d3 = self.dec3(torch.cat([m, e3], dim=1))
        d2 = self.dec2(torch.cat([F.interpolate(d3, scale_factor=2.0), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1))
        return self.head(d1)


class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResidualCNN(nn.Module):
    """Stem, residual blocks with BatchNorm, global pooling, classifier."""

    def __init__(self, width: int = 8, blocks: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[_ResBlock(width) for _ in range(blocks)])
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.fc(h.mean(dim=(2, 3)))


class KeywordTupleModel(nn.Module):
    """forward(x, *, scale) -> (reconstruction, code): `encode.weight` is used at both ends."""

    def __init__(self, dim: int = 12, hidden: int = 16, layers: int = 4):
        super().__init__()
        self.encode = nn.Linear(dim, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encode(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h)) * scale
        code = self.norm(h)
        recon = code @ self.encode.weight  # the first layer's weight again, transposed
        return recon, code.mean(dim=-1)


def tuple_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Loss for KeywordTupleModel: reconstruction error plus a small penalty on the code."""
    recon, code = output
    return F.mse_loss(recon, target) + 0.1 * code.pow(2).mean()
