"""A Wav2Vec2/HuBERT-style post-norm encoder on frame features: attention with the scores scaled after
the product, an attention dropout module, and the encoder layer's `dropout(hidden); residual + hidden`;
the feed-forward's intermediate and output dropouts, its residual added by the caller."""

import torch
from _train import train
from torch import nn


class Wav2Vec2Attention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, dropout=0.1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = dropout
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len = hidden_states.shape[:-1]
        kv_input_shape = (bsz, -1, self.num_heads, self.head_dim)
        q_input_shape = (bsz, tgt_len, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(*q_input_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(*kv_input_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(*kv_input_shape).transpose(1, 2)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(attn_output)


class Wav2Vec2FeedForward(nn.Module):
    def __init__(self, hidden_size=32, intermediate_size=64, dropout=0.1):
        super().__init__()
        self.intermediate_dropout = nn.Dropout(dropout)
        self.intermediate_dense = nn.Linear(hidden_size, intermediate_size)
        self.output_dense = nn.Linear(intermediate_size, hidden_size)
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, hidden_states):
        hidden_states = self.intermediate_dense(hidden_states)
        hidden_states = nn.functional.gelu(hidden_states)
        hidden_states = self.intermediate_dropout(hidden_states)
        hidden_states = self.output_dense(hidden_states)
        hidden_states = self.output_dropout(hidden_states)
        return hidden_states


class Wav2Vec2EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Wav2Vec2Attention()
        self.dropout = nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(32, eps=1e-5)
        self.feed_forward = Wav2Vec2FeedForward()
        self.final_layer_norm = nn.LayerNorm(32, eps=1e-5)

    def forward(self, hidden_states, attention_mask=None):
        attn_residual = hidden_states
        hidden_states = self.attention(hidden_states, attention_mask=attention_mask)
        hidden_states = self.dropout(hidden_states)
        hidden_states = attn_residual + hidden_states

        hidden_states = self.layer_norm(hidden_states)
        hidden_states = hidden_states + self.feed_forward(hidden_states)
        hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class Wav2Vec2Encoder(nn.Module):
    def __init__(self, vocab=101, layers=2):
        super().__init__()
        self.feature_projection = nn.Embedding(vocab, 32)
        self.layer_norm = nn.LayerNorm(32, eps=1e-5)
        self.dropout = nn.Dropout(0.1)
        self.layers = nn.ModuleList([Wav2Vec2EncoderLayer() for _ in range(layers)])
        self.lm_head = nn.Linear(32, vocab)

    def forward(self, input_ids):
        keep = torch.ones(input_ids.shape, dtype=torch.float32)
        keep[:, -4:] = 0.0
        attention_mask = 1.0 - keep[:, None, None, :]
        attention_mask = attention_mask * torch.finfo(torch.float32).min
        attention_mask = attention_mask.expand(
            attention_mask.shape[0], 1, attention_mask.shape[-1], attention_mask.shape[-1]
        )
        hidden_states = self.dropout(self.layer_norm(self.feature_projection(input_ids)))
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return self.lm_head(hidden_states)


if __name__ == "__main__":
    train(Wav2Vec2Encoder(), 101, 16)
