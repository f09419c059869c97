"""A fairseq-style transformer encoder: time-first tensors, q scaled in place, torch.bmm on 3-D views, the
attention mask added in place, a float32 softmax helper, dropout, then the residual add after dropout."""

import torch
import torch.nn.functional as F
from _train import train
from torch import nn


def softmax(x, dim: int, onnx_trace: bool = False):
    if onnx_trace:
        return F.softmax(x.float(), dim=dim)
    else:
        return F.softmax(x, dim=dim, dtype=torch.float32)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.onnx_trace = False
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, query, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        attn_weights_float = softmax(attn_weights, dim=-1, onnx_trace=self.onnx_trace)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)

        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim, heads, ffn_dim, dropout):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout_module = nn.Dropout(dropout)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, attn_mask):
        residual = x
        x = self.self_attn(x, attn_mask)
        x = self.dropout_module(x)
        x = residual + x
        x = self.self_attn_layer_norm(x)

        residual = x
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = residual + x
        return self.final_layer_norm(x)


class Encoder(nn.Module):
    def __init__(self, vocab=101, dim=32, heads=4, ffn=64, layers=2, dropout=0.1):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(dim, heads, ffn, dropout) for _ in range(layers)]
        )
        self.output_projection = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed_tokens(tokens).transpose(0, 1)
        T = x.size(0)
        causal = torch.triu(torch.full((T, T), float("-inf")), 1)
        for layer in self.layers:
            x = layer(x, causal)
        return self.output_projection(x.transpose(0, 1))


if __name__ == "__main__":
    train(Encoder(), 101, 16)
