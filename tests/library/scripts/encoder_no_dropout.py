"""nn.TransformerEncoder trained without dropout: no dropout + residual chain to fuse (must not be found)."""

import torch
import torch.nn as nn

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
model = nn.TransformerEncoder(layer, num_layers=2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 16, 32)
for step in range(6):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
