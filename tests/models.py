"""Small test models shared by model-level tests (cpu in CI, cuda on the GPU machine)."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """conv (stride/padding/groups) + BN + relu + max/avg/adaptive pool + flatten + linear."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=1, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(32, 32, 1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x))


def transformer_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                      batch_first=True)


class AttentionBlock(nn.Module):
    """A pre-LN-free transformer block written with plain ops (linear, view/permute, matmul,
    softmax, layer norm, GELU): every size follows the input's (batch, sequence)."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-1, -2) * (c // self.heads) ** -0.5).softmax(-1)
        x = self.norm(x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.ff(x)


class WithUnsupported(nn.Module):
    """A model with an op gac does not compile (nonzero has a data-dependent shape in eager,
    so we use a deterministic stand-in: torch.special.i0, which has no lowering)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.special.i0(h)  # eager fallback
        return self.fc2(h).softmax(-1)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running stats and affine params so BN is really tested."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return MLP().eval(), (torch.randn(8, 32, generator=g),)
    if name == "cnn":
        return randomize_bn(SmallCNN()).eval(), (torch.randn(2, 3, 32, 32, generator=g),)
    if name == "transformer":
        return transformer_layer().eval(), (torch.randn(2, 12, 64, generator=g),)
    if name == "unsupported":
        return WithUnsupported().eval(), (torch.randn(4, 16, generator=g),)
    if name == "attention":
        return AttentionBlock().eval(), (torch.randn(2, 9, 64, generator=g),)
    raise KeyError(name)


MODEL_NAMES = ["mlp", "cnn", "transformer", "unsupported"]
# fp32 model tolerances: outputs after several layers, against eager fp32
MODEL_TOL = dict(rtol=1e-4, atol=1e-4)
