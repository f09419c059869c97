"""A DeBERTa-style encoder: masked_fill with finfo.min, softmax, masked positions zeroed, dropout; a
hand-written LayerNorm in the pytorch-pretrained-bert style."""

import math

import torch
from _train import train
from torch import nn


class BertLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class DisentangledSelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.query_proj = nn.Linear(hidden, hidden)
        self.key_proj = nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, -1)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query_proj(hidden_states))
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states))
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states))
        scale = math.sqrt(query_layer.size(-1))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2) / scale)
        rmask = ~(attention_mask.to(torch.bool))
        attention_scores = attention_scores.masked_fill(rmask, torch.finfo(attention_scores.dtype).min)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.masked_fill(rmask, 0.0)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (-1,))


class DebertaLayer(nn.Module):
    def __init__(self, hidden, heads, intermediate, dropout):
        super().__init__()
        self.attention = DisentangledSelfAttention(hidden, heads, dropout)
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = BertLayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = BertLayerNorm(hidden)
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        attention_output = self.dropout(self.dense(attention_output))
        attention_output = self.LayerNorm(attention_output + hidden_states)
        layer_output = self.output(nn.functional.gelu(self.intermediate(attention_output)))
        layer_output = self.output_dropout(layer_output)
        return self.output_norm(layer_output + attention_output)


class DebertaEncoder(nn.Module):
    def __init__(self, vocab=101, hidden=32, heads=4, intermediate=64, layers=2, dropout=0.1):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.layer = nn.ModuleList(
            [DebertaLayer(hidden, heads, intermediate, dropout) for _ in range(layers)]
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        keep = torch.ones_like(input_ids)
        keep[:, -2:] = 0
        attention_mask = keep[:, None, None, :] * keep[:, None, :, None]
        hidden_states = self.embeddings(input_ids)
        for layer in self.layer:
            hidden_states = layer(hidden_states, attention_mask)
        return self.head(hidden_states)


if __name__ == "__main__":
    train(DebertaEncoder(), 101, 16)
