"""The annotated transformer's attention(): masked_fill(mask == 0, -1e9) -> softmax -> dropout, and GPT's causal mask."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)  # expect: sdpa_attention start
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)  # expect: fused_softmax start
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)  # expect: fused_softmax end
    return torch.matmul(p_attn, value), p_attn  # expect: sdpa_attention end


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, seq=8):
        super().__init__()
        self.n_head = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        self.c_proj = nn.Linear(hidden, hidden)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # expect: gpt sdpa start
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))  # expect: gpt softmax start
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)  # expect: gpt softmax end
        y = att @ v  # expect: gpt sdpa end
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return x + self.resid_dropout(self.c_proj(y))  # expect: gpt dropout_add


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.drop = nn.Dropout(0.1)
        self.gpt = CausalSelfAttention()

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out, _ = attention(q, k, v, mask, self.drop)
        return self.gpt(out.transpose(1, 2).reshape(2, 8, 32))


model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8, 32)
mask = torch.ones(2, 1, 1, 8)
mask[..., -2:] = 0
for _ in range(6):
    model(x, mask).sum().backward()
    opt.step()
    opt.zero_grad()
