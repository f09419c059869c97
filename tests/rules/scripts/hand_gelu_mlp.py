"""Activations written by hand in an MLP: GPT-2's tanh GELU, an erf GELU in a module, SiLU and QuickGELU."""

import math

import torch
import torch.nn as nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


def new_gelu(x):
    return (  # expect: fuse_region gelu_tanh start
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )  # expect: fuse_region gelu_tanh end


class ErfGELU(nn.Module):
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # expect: fuse_region gelu_erf


class MLP(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.fc3 = nn.Linear(width, width)
        self.fc4 = nn.Linear(width, width)
        self.act = ErfGELU()

    def forward(self, x):
        h = self.fc2(new_gelu(self.fc1(x)))
        h = self.act(h)
        g = self.fc3(h)
        g = g * torch.sigmoid(g)  # expect: fuse_region silu
        q = self.fc4(g)
        return q * torch.sigmoid(1.702 * q)  # expect: fuse_region sigmoid_gate


model = MLP().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256, device=device)
for _ in range(6):
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
