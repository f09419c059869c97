"""The same kinds of model with the fused forms already: F.gelu, F.silu, nn.Dropout, a plain gather."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class Fused(nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)
        self.table = nn.Parameter(torch.randn(16, width))

    def forward(self, x, idx):
        h = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        h = F.silu(h) + F.gelu(h)
        h = self.drop(h)
        return h + torch.gather(self.table, 0, idx)


model = Fused().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 128, device=device)
idx = torch.randint(0, 16, (32, 128), device=device)
for _ in range(6):
    model(x, idx).square().mean().backward()
    opt.step()
    opt.zero_grad()
