"""An x-transformers-style attention: einsum products, the mask value read from a name, pre-norm blocks
whose feed-forward ends in dropout and whose residual is added outside."""

import torch
import torch.nn.functional as F
from _train import train
from torch import einsum, nn


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        h = self.heads
        q = self.to_q(x).view(b, n, h, -1).transpose(1, 2)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        k = k.view(b, n, h, -1).transpose(1, 2)
        v = v.view(b, n, h, -1).transpose(1, 2)

        dots = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        dots = dots.masked_fill(~mask, mask_value)
        attn = F.softmax(dots, dim=-1)
        attn = self.dropout(attn)

        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):
    def __init__(self, vocab=101, dim=32, depth=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [
                nn.ModuleList([nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim), FeedForward(dim)])
                for _ in range(depth)
            ]
        )
        self.to_logits = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        for norm1, attn, norm2, ff in self.layers:
            x = attn(norm1(x), mask) + x
            x = ff(norm2(x)) + x
        return self.to_logits(x)


if __name__ == "__main__":
    train(Transformer(), 101, 16)
