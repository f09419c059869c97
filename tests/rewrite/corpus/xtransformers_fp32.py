"""An x-transformers/lucidrains-style attention of the later releases: q scaled before an einsum written
without spaces, the mask value -finfo.max read from a name and applied to ~mask, a float32 softmax built
with functools.partial and kept as an attribute, the result cast back with .type(dtype), dropout, einsum."""

from functools import partial

import torch
import torch.nn.functional as F
from _train import train
from torch import einsum, nn


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = dim_head**-0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attn_fn = partial(F.softmax, dtype=torch.float32)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        q = q * self.scale
        dtype = q.dtype

        sim = einsum("bhid,bhjd->bhij", q, k)
        mask_value = -torch.finfo(sim.dtype).max
        if mask is not None:
            sim = sim.masked_fill(~mask, mask_value)

        attn = self.attn_fn(sim, dim=-1)
        attn = attn.type(dtype)
        attn = self.dropout(attn)

        out = einsum("bhij,bhjd->bhid", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Residual(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs) + x


class Transformer(nn.Module):
    def __init__(self, vocab=101, dim=32, depth=2):
        super().__init__()
        self.token_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [
                nn.ModuleList(
                    [
                        Residual(dim, Attention(dim)),
                        Residual(
                            dim, nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                        ),
                    ]
                )
                for _ in range(depth)
            ]
        )
        self.to_logits = nn.Linear(dim, vocab)

    def forward(self, ids):
        n = ids.shape[1]
        causal = torch.ones((n, n), dtype=torch.bool).triu(1)
        mask = ~causal[None, None]
        x = self.token_emb(ids)
        for attn, ff in self.layers:
            x = attn(x, mask=mask)
            x = ff(x)
        return self.to_logits(x)


if __name__ == "__main__":
    train(Transformer(), 101, 16)
