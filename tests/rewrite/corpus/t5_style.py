"""A T5-style encoder: relative position bias plus mask, no scale, float32 softmax, RMS norm, FF residual."""

import torch
from _train import train
from torch import nn


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class T5Attention(nn.Module):
    def __init__(self, d_model, n_heads, dropout, has_relative_attention_bias=True):
        super().__init__()
        self.n_heads = n_heads
        self.key_value_proj_dim = d_model // n_heads
        self.inner_dim = d_model
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout
        self.relative_attention_bias = nn.Embedding(32, n_heads)

    def compute_bias(self, query_length, key_length, device):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = (memory_position - context_position).clamp(-16, 15) + 16
        values = self.relative_attention_bias(relative_position)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, hidden_states, mask=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def shape(states):
            return states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        query_states = shape(self.q(hidden_states))
        key_states = shape(self.k(hidden_states))
        value_states = shape(self.v(hidden_states))

        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        position_bias = self.compute_bias(seq_length, seq_length, device=scores.device)
        if mask is not None:
            position_bias = position_bias + mask

        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)
        return self.o(attn_output)


class T5LayerFF(nn.Module):
    def __init__(self, d_model, d_ff, dropout):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.layer_norm = T5LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states):
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.wo(nn.functional.relu(self.wi(forwarded_states)))
        hidden_states = hidden_states + self.dropout(forwarded_states)
        return hidden_states


class T5Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout):
        super().__init__()
        self.layer_norm = T5LayerNorm(d_model)
        self.attention = T5Attention(d_model, n_heads, dropout)
        self.dropout = nn.Dropout(dropout)
        self.ff = T5LayerFF(d_model, d_ff, dropout)

    def forward(self, hidden_states, mask):
        attention_output = self.attention(self.layer_norm(hidden_states), mask)
        hidden_states = hidden_states + self.dropout(attention_output)
        return self.ff(hidden_states)


class T5Encoder(nn.Module):
    def __init__(self, vocab=101, d_model=32, n_heads=4, d_ff=64, layers=2, dropout=0.1):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.block = nn.ModuleList([T5Block(d_model, n_heads, d_ff, dropout) for _ in range(layers)])
        self.final_layer_norm = T5LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids):
        keep = torch.ones_like(input_ids)
        keep[:, -3:] = 0
        mask = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.block:
            hidden_states = layer(hidden_states, mask)
        return self.lm_head(self.final_layer_norm(hidden_states))


if __name__ == "__main__":
    train(T5Encoder(), 101, 16)
