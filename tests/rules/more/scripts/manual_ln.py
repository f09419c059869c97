"""Two hand-written layer norms: one equal to F.layer_norm (safe), one the Annotated-Transformer way
(unbiased std, eps outside the square root: not equal, unsafe). Markers name the lines a finding spans."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"


class BertStyleLayerNorm(nn.Module):
    def __init__(self, hidden, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)  # expect: manual_layernorm safe start
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight * x + self.bias  # expect: manual_layernorm safe end


class AnnotatedLayerNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(hidden))
        self.b_2 = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)  # expect: manual_layernorm unsafe start
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2  # expect: manual_layernorm unsafe end


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.norm1 = BertStyleLayerNorm(hidden)
        self.norm2 = AnnotatedLayerNorm(hidden)

    def forward(self, x):
        x = self.norm1(x + torch.relu(self.fc(x)))
        return self.norm2(x + self.fc(x))


model = Block(64).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16, 64, device=device)
for _ in range(20):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
