"""DeBERTa's XSoftmax (mask -> softmax -> mask, in an autograd.Function) and an in-place residual `x += drop(h)`."""

import torch
import torch.nn as nn

torch.manual_seed(0)


class XSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mask, dim):
        rmask = ~(mask.to(torch.bool))
        output = input.masked_fill(rmask, torch.finfo(input.dtype).min)  # expect: fused_softmax start
        output = torch.softmax(output, dim)
        output.masked_fill_(rmask, 0)  # expect: fused_softmax end
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad_output, output, -1, output.dtype), None, None


class Block(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(hidden, 2 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.1)

    def scores(self, x):
        B, S, C = x.shape
        q, k = self.qk(x).view(B, S, 2, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return q @ k.transpose(-1, -2)

    def forward(self, x, mask):
        probs = XSoftmax.apply(self.scores(x), mask, -1)
        h = (probs @ x.unsqueeze(1).expand(-1, self.heads, -1, -1)).mean(1)
        x = x.clone()
        x += self.drop(self.proj(h))  # expect: fused_dropout_add
        return x


model = Block()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8, 32)
mask = torch.ones(2, 1, 1, 8)
mask[..., -3:] = 0
for _ in range(6):
    model(x, mask).sum().backward()
    opt.step()
    opt.zero_grad()
