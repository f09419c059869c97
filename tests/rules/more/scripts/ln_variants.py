"""Other spellings of a hand-written layer norm; each function's marker comments name the lines a
finding must span and whether F.layer_norm is the same function there (safe) or not (unsafe)."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def norm_rsqrt(x):
    mu = x.mean(dim=-1, keepdim=True)  # expect: rsqrt start
    return (x - mu) * torch.rsqrt(x.var(dim=-1, keepdim=True, unbiased=False) + EPS)  # expect: rsqrt end


def norm_var_mean(x, weight):
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)  # expect: var_mean start
    y = (x - mean) / (var + EPS).sqrt()
    return y * weight  # expect: var_mean end


def norm_channels(x):
    mean = x.mean(1, keepdim=True)  # expect: channels start
    var = ((x - mean) ** 2).mean(1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS)  # expect: channels end


def norm_two_dims(x):
    mean = x.mean((-2, -1), keepdim=True)  # expect: two dims start
    var = (x - mean).square().mean((-2, -1), keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS)  # expect: two dims end


class Model(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        h = norm_rsqrt(self.fc(x))
        h = norm_var_mean(h, self.weight)
        h = norm_channels(h)
        return norm_two_dims(h)


model = Model(32).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8, 32, device=device)
for _ in range(20):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
