"""nn.TransformerEncoder trained: in training mode each layer takes torch's slow path, written op by op
in torch/nn/modules/transformer.py (dropout in _sa_block / _ff_block, the residual add in forward)."""

import torch
import torch.nn as nn

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
model = nn.TransformerEncoder(layer, num_layers=2)  # expect: model
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 16, 32)
for step in range(6):
    loss = model(x).square().mean()  # expect: call
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
