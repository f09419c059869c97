"""A CLIP-style text encoder as transformers 4.x wrote it: q projected then multiplied by `scale`, torch.bmm
on 3-D views, a causal mask and a padding mask each added to a 4-D view, softmax, functional dropout;
quick_gelu MLP, pre-norm residuals without dropout."""

import torch
from _train import train
from torch import nn


class CLIPAttention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, dropout=0.1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.dropout = dropout
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))

        if causal_attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)

        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class CLIPMLP(nn.Module):
    def __init__(self, hidden_size=32, intermediate_size=64):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = hidden_states * torch.sigmoid(1.702 * hidden_states)
        return self.fc2(hidden_states)


class CLIPEncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = CLIPAttention()
        self.layer_norm1 = nn.LayerNorm(32)
        self.mlp = CLIPMLP()
        self.layer_norm2 = nn.LayerNorm(32)

    def forward(self, hidden_states, attention_mask, causal_attention_mask):
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask, causal_attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class CLIPTextTransformer(nn.Module):
    def __init__(self, vocab=101, layers=2):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, 32)
        self.position_embedding = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([CLIPEncoderLayer() for _ in range(layers)])
        self.final_layer_norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, vocab)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        causal = (
            torch.empty(bsz, seq_len, seq_len).fill_(torch.finfo(torch.float32).min).triu_(1).unsqueeze(1)
        )
        keep = torch.ones_like(input_ids, dtype=torch.float32)
        keep[:, -2:] = 0.0
        padding = ((1.0 - keep[:, None, None, :]) * torch.finfo(torch.float32).min).expand(
            bsz, 1, seq_len, seq_len
        )
        positions = torch.arange(seq_len, device=input_ids.device)[None]
        hidden_states = self.token_embedding(input_ids) + self.position_embedding(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, padding, causal)
        return self.head(self.final_layer_norm(hidden_states))


if __name__ == "__main__":
    train(CLIPTextTransformer(), 101, 16)
