"""Nothing to report for the chain rules: SDPA already, a top-k sampling mask, dropout without residual, no dropout."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self, hidden=32, heads=4, vocab=64):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)  # residual without dropout
        h = self.drop(x)  # dropout without residual
        logits = self.head(h)
        v, _ = torch.topk(logits, 5)  # top-k sampling mask, then softmax: not attention
        logits = logits.masked_fill(logits < v[..., -1:], float("-inf"))
        probs = F.softmax(logits, dim=-1)
        return (probs * logits.clamp(min=-10)).sum()


model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8, 32)
for _ in range(6):
    model(x).backward()
    opt.step()
    opt.zero_grad()
