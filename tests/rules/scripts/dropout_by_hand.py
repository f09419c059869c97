"""Dropout written by hand: DeBERTa's XDropout (an autograd.Function with a bool mask) and an inline one."""

import torch
import torch.nn as nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class XDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, drop_prob):
        keep = torch.empty_like(input).bernoulli_(1 - drop_prob)  # expect: fuse_region function start
        mask = (1 - keep).to(torch.bool)
        ctx.scale = 1.0 / (1 - drop_prob)
        ctx.save_for_backward(mask)
        return input.masked_fill(mask, 0) * ctx.scale  # expect: fuse_region function end

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        return grad_output.masked_fill(mask, 0) * ctx.scale, None


class Net(nn.Module):
    def __init__(self, width=128, p=0.1):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.p = p

    def forward(self, x):
        h = XDropout.apply(torch.relu(self.fc1(x)), self.p)
        h = self.fc2(h)
        mask = (torch.rand_like(h) > self.p).float()  # expect: fuse_region inline start
        return h * mask / (1 - self.p)  # expect: fuse_region inline end


model = Net().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 128, device=device)
for _ in range(6):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
