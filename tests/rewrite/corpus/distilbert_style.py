"""A DistilBERT-style encoder: q divided by sqrt(head dim) before the product, the padding mask compared
with 0, viewed and expanded to the scores, filled with a finfo.min tensor; the feed-forward ends in
dropout and its residual is added by the block (across modules: not a site the rewrite can reach)."""

import math

import torch
from _train import train
from torch import nn


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, dim, n_heads, attention_dropout):
        super().__init__()
        self.n_heads = n_heads
        self.dim = dim
        self.dropout = nn.Dropout(p=attention_dropout)
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, query, key, value, mask):
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dim_per_head = self.dim // self.n_heads
        mask_reshp = (bs, 1, 1, k_length)

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(query))
        k = shape(self.k_lin(key))
        v = shape(self.v_lin(value))

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(mask_reshp).expand_as(scores)
        scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))

        weights = nn.functional.softmax(scores, dim=-1)
        weights = self.dropout(weights)

        context = torch.matmul(weights, v)
        context = unshape(context)
        return self.out_lin(context)


class FFN(nn.Module):
    def __init__(self, dim, hidden_dim, dropout):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.lin1 = nn.Linear(dim, hidden_dim)
        self.lin2 = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        x = self.lin1(x)
        x = nn.functional.gelu(x)
        x = self.lin2(x)
        x = self.dropout(x)
        return x


class TransformerBlock(nn.Module):
    def __init__(self, dim=32, n_heads=4, hidden_dim=64, dropout=0.1):
        super().__init__()
        self.attention = MultiHeadSelfAttention(dim, n_heads, dropout)
        self.sa_layer_norm = nn.LayerNorm(normalized_shape=dim, eps=1e-12)
        self.ffn = FFN(dim, hidden_dim, dropout)
        self.output_layer_norm = nn.LayerNorm(normalized_shape=dim, eps=1e-12)

    def forward(self, x, attn_mask):
        sa_output = self.attention(query=x, key=x, value=x, mask=attn_mask)
        sa_output = self.sa_layer_norm(sa_output + x)
        ffn_output = self.ffn(sa_output)
        ffn_output = self.output_layer_norm(ffn_output + sa_output)
        return ffn_output


class DistilBert(nn.Module):
    def __init__(self, vocab=101, dim=32, n_layers=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(64, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.layer = nn.ModuleList([TransformerBlock(dim) for _ in range(n_layers)])
        self.vocab_projector = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        attention_mask = torch.ones_like(input_ids)
        attention_mask[:, -2:] = 0
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        hidden_state = self.dropout(self.LayerNorm(embeddings))
        for layer_module in self.layer:
            hidden_state = layer_module(hidden_state, attention_mask)
        return self.vocab_projector(hidden_state)


if __name__ == "__main__":
    train(DistilBert(), 101, 16)
