"""A model as `opadvisor apply` leaves it: its chains are opadvisor.kernels' fused ops (which run their
plain chain or reference code where the kernel does not run, e.g. on the CPU or below a size threshold)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from opadvisor.kernels import bias_dropout_add, dropout, masked_softmax, quick_gelu

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, width=128, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(width))
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        probs = masked_softmax(q @ k.transpose(-1, -2), mask, scale=(c // self.heads) ** -0.5, dropout_p=0.1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, t, c)
        x = self.norm(bias_dropout_add(self.proj(ctx), self.proj_bias, x, 0.1, self.training))
        return x + dropout(self.fc2(quick_gelu(self.fc1(x))), 0.1)


model = nn.Sequential(Block(), Block()).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 64, 128, device=device)
mask = torch.zeros(8, 1, 1, 64, dtype=torch.bool, device=device)
mask[:, :, :, 56:] = True


def step():
    out = x
    for block in model:
        out = block(out, mask)
    F.mse_loss(out, x).backward()
    opt.step()
    opt.zero_grad()


for _ in range(6):
    step()
