"""A GAN-like loop: two optimizers step per iteration; one training step each iteration."""

import torch

g = torch.nn.Linear(4, 4)
d = torch.nn.Linear(4, 1)
opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
for _ in range(8):
    d(g(torch.randn(2, 4))).mean().backward()
    opt_d.step()
    opt_g.step()
    opt_d.zero_grad()
    opt_g.zero_grad()
