"""Normalisations that are not a hand-written layer norm: nn.LayerNorm itself, an RMSNorm (no mean
subtraction), and a whole-tensor standardisation of a 1-D vector. manual_layernorm must stay silent."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.rms = RMSNorm(hidden)

    def forward(self, x):
        x = self.ln(x + torch.relu(self.fc(x)))
        return self.rms(x + self.fc(x))


model = Block(64).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16, 64, device=device)
for _ in range(20):
    per_row = model(x).square().mean(-1).flatten()
    weights = (per_row - per_row.mean()) / (per_row.std() + 1e-8)  # a 1-D standardisation, not a layer norm
    loss = (per_row * weights.detach()).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
