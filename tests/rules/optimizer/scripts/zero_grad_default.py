"""The same loop with zero_grad's default (set_to_none=True): nothing is zeroed, nothing to find."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(16, 32)
for _ in range(8):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    model.zero_grad(set_to_none=True)
