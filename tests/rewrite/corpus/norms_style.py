"""Hand-written normalisations as public code writes them: ConvNeXt's LayerNorm (channels-last through
F.layer_norm, channels-first by hand: mean, (x - u).pow(2).mean, sqrt), a var(unbiased=False)/rsqrt
LayerNorm with a gain only (lucidrains), torch.var_mean, the Annotated Transformer's std-based norm (eps
outside the sqrt, unbiased std: not a LayerNorm), and an RMSNorm (not a LayerNorm)."""

import torch
import torch.nn.functional as F
from _train import train
from torch import nn


class ConvNextLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-6, data_format="channels_last"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = eps
        self.data_format = data_format
        self.normalized_shape = (normalized_shape,)

    def forward(self, x):
        if self.data_format == "channels_last":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        x = self.weight[:, None] * x + self.bias[:, None]
        return x


class GainLayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = torch.var(x, dim=-1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=-1, keepdim=True)
        return (x - mean) * (var + self.eps).rsqrt() * self.g


class VarMeanLayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
        x = (x - mean) * torch.rsqrt(var + self.eps)
        return x * self.weight + self.bias


class AnnotatedLayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm_cf = ConvNextLayerNorm(dim, data_format="channels_first")
        self.mix = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.norm_cl = ConvNextLayerNorm(dim)
        self.norm_gain = GainLayerNorm(dim)
        self.norm_vm = VarMeanLayerNorm(dim)
        self.norm_annotated = AnnotatedLayerNorm(dim)
        self.norm_rms = RMSNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.mix(self.norm_cf(x.transpose(1, 2))).transpose(1, 2)
        x = x + self.fc2(F.gelu(self.fc1(self.norm_cl(x))))
        x = x + self.fc2(F.gelu(self.fc1(self.norm_gain(x))))
        x = x + self.fc2(F.gelu(self.fc1(self.norm_vm(x))))
        x = x + self.fc2(F.gelu(self.fc1(self.norm_annotated(x))))
        return self.norm_rms(x)


class Model(nn.Module):
    def __init__(self, vocab=101, dim=32, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


if __name__ == "__main__":
    train(Model(), 101, 16)
