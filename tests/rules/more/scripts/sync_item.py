"""Reads the loss with .item() every step: one host<-device sync per step (host_sync must point here)."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
width = 1024 if device == "cuda" else 64  # small on a CPU-only machine
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, 256)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256, device=device)
history = []
for _ in range(30):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    history.append(loss.item())  # expect: host_sync
