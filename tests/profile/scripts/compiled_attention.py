"""A small attention block trained under torch.compile (aot_eager: no C++ compiler needed on the CPU)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = self.drop(F.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.drop(self.out(y))


def main():
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mask = torch.rand(1, 1, 6, 6) > 0.7
    mask[..., 0] = False
    for _ in range(6):
        loss = compiled(torch.randn(4, 6, 16), mask).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
