"""BERT-style layer: scores / sqrt(d) + mask -> softmax -> dropout -> @ v; dense -> dropout -> LayerNorm(h + x)."""

import math

import torch
import torch.nn as nn

torch.manual_seed(0)


class Layer(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)
        self.dense = nn.Linear(hidden, hidden)
        self.out_dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(hidden)

    def split(self, x):
        B, S, _ = x.shape
        return x.view(B, S, self.heads, self.d).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2))  # expect: sdpa_attention start
        scores = scores / math.sqrt(self.d)
        scores = scores + mask  # expect: fused_softmax start
        probs = nn.functional.softmax(scores, dim=-1)
        probs = self.dropout(probs)  # expect: fused_softmax end
        ctx = torch.matmul(probs, v)  # expect: sdpa_attention end
        ctx = ctx.permute(0, 2, 1, 3).reshape(x.shape)
        h = self.dense(ctx)  # expect: fused_dropout_add start
        h = self.out_dropout(h)
        return self.norm(h + x)  # expect: fused_dropout_add end


model = nn.ModuleList([Layer(), Layer()])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8, 32)
mask = torch.zeros(2, 1, 1, 8)
mask[..., -2:] = -10000.0
for _ in range(6):
    h = x
    for layer in model:
        h = layer(h, mask)
    h.sum().backward()
    opt.step()
    opt.zero_grad()
