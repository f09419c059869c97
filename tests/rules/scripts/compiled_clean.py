"""A compiled step with no graph break and a fixed input size: graph_break and recompile find nothing.

It compiles with the decorator form, whose call site and keywords the profile records as the user wrote
them (torch calls torch.compile again inside the decorator, with every keyword at its default).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, target = torch.randn(8, 32), torch.randn(8, 32)


@torch.compile(backend="aot_eager")  # expect: compile
def loss_of(x, target):
    return F.mse_loss(model(x), target)


for _step in range(6):
    loss = loss_of(x, target)
    loss.backward()
    opt.step()
    opt.zero_grad()
