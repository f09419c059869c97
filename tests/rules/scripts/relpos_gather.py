"""DeBERTa's relative-position scores: clamp the bucketed positions, gather, transpose, scale, add."""

import math

import torch
import torch.nn as nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, SPAN = 4, 8


class RelativeBias(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.rel = nn.Parameter(torch.randn(2 * SPAN, hidden) * 0.02)

    def split(self, x):
        x = x.view(x.size()[:-1] + (HEADS, -1))
        return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))

    def bias(self, q, k, relative_pos, scale):
        pos_k = self.split(self.k(self.rel.unsqueeze(0))).repeat(q.size(0) // HEADS, 1, 1)
        pos_q = self.split(self.q(self.rel.unsqueeze(0))).repeat(q.size(0) // HEADS, 1, 1)
        c2p_att = torch.bmm(q, pos_k.transpose(-1, -2))
        c2p_pos = torch.clamp(relative_pos + SPAN, 0, SPAN * 2 - 1)  # expect: fuse_region relpos start
        c2p_att = torch.gather(
            c2p_att, dim=-1, index=c2p_pos.squeeze(0).expand([q.size(0), q.size(1), q.size(1)])
        )
        score = c2p_att / scale
        p2c_att = torch.bmm(k, pos_q.transpose(-1, -2))
        p2c_pos = torch.clamp(-relative_pos + SPAN, 0, SPAN * 2 - 1)
        p2c_att = torch.gather(
            p2c_att, dim=-1, index=p2c_pos.squeeze(0).expand([q.size(0), k.size(1), k.size(1)])
        )
        score += p2c_att.transpose(-1, -2) / scale  # expect: fuse_region relpos end
        return score

    def forward(self, x):
        q, k = self.split(self.q(x)), self.split(self.k(x))
        s = x.size(1)
        rel = (
            torch.arange(s, device=x.device)[:, None] - torch.arange(s, device=x.device)[None, :]
        ).unsqueeze(0)
        scores = torch.bmm(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1) * 3) + self.bias(
            q, k, rel, math.sqrt(q.size(-1) * 3)
        )
        return torch.softmax(scores, -1).sum()


model = RelativeBias().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 32, 64, device=device)
for _ in range(6):
    model(x).backward()
    opt.step()
    opt.zero_grad()
