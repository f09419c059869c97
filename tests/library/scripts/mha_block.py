"""nn.MultiheadAttention called for weights the caller drops (`out, _ = ...`): torch then computes the
attention op by op (bmm, softmax, dropout, bmm) in torch/nn/functional.py instead of SDPA."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        out, _ = self.attn(x, x, x)  # expect: call
        return self.norm(x + out)


torch.manual_seed(0)
model = nn.Sequential(Block(), Block())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 16, 32)
for step in range(6):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
