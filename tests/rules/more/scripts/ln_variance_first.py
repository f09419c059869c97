"""A hand-written layer norm whose variance runs before its mean (lucidrains' gain-only LayerNorm); the
marker comments name the lines a finding must span."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def norm_variance_first(x, g):
    var = torch.var(x, dim=-1, unbiased=False, keepdim=True)  # expect: variance first start
    mean = torch.mean(x, dim=-1, keepdim=True)
    return (x - mean) * (var + EPS).rsqrt() * g  # expect: variance first end


class Model(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.g = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return norm_variance_first(self.fc(x), self.g)


model = Model(32).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8, 32, device=device)
for _ in range(20):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
