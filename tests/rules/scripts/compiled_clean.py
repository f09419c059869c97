"""A compiled model with no graph break and a fixed input size: graph_break and recompile find nothing."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
compiled = torch.compile(model, backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, target = torch.randn(8, 32), torch.randn(8, 32)
for _step in range(6):
    loss = F.mse_loss(compiled(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
