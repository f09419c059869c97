"""A BLOOM-style decoder as transformers 4.x wrote it: ALiBi added through `alibi.baddbmm(batch1=q,
batch2=k, beta=..., alpha=inv_norm_factor)`, the 3-D result viewed to 4-D, the bool mask applied with the
function form torch.masked_fill(scores, mask, finfo.min), a float32 softmax cast back to the input dtype,
dropout, bmm on a 3-D view; a module-level dropout_add(x, residual, prob, training)."""

import math

import torch
import torch.nn.functional as F
from _train import train
from torch import nn


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def dropout_add(x, residual, prob, training):
    out = F.dropout(x, p=prob, training=training)
    out = residual + out
    return out


class BloomAttention(nn.Module):
    def __init__(self, hidden_size=32, n_head=4, attention_dropout=0.1, hidden_dropout=0.1):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = n_head
        self.head_dim = hidden_size // n_head
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.hidden_dropout = hidden_dropout
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.attention_dropout = nn.Dropout(attention_dropout)

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def forward(self, hidden_states, residual, alibi, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(
            batch_size * self.num_heads, self.head_dim, q_length
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size * self.num_heads, q_length, self.head_dim
        )

        matmul_result = alibi.baddbmm(
            batch1=query_layer,
            batch2=key_layer,
            beta=self.beta,
            alpha=self.inv_norm_factor,
        )
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, -1)

        input_dtype = attention_scores.dtype
        attn_weights = torch.masked_fill(
            attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min
        )
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)
        attention_probs = self.attention_dropout(attention_probs)

        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = context_layer.view(batch_size, self.num_heads, q_length, self.head_dim)
        context_layer = context_layer.permute(0, 2, 1, 3).reshape(batch_size, q_length, self.hidden_size)

        output_tensor = self.dense(context_layer)
        output_tensor = dropout_add(output_tensor, residual, self.hidden_dropout, self.training)
        return output_tensor


class BloomBlock(nn.Module):
    def __init__(self, hidden_size=32):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.self_attention = BloomAttention(hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)
        self.hidden_dropout = 0.1

    def forward(self, hidden_states, alibi, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(layernorm_output, hidden_states, alibi, attention_mask)
        layernorm_output = self.post_attention_layernorm(attention_output)
        intermediate = F.gelu(self.dense_h_to_4h(layernorm_output), approximate="tanh")
        output = self.dense_4h_to_h(intermediate)
        return dropout_add(output, attention_output, self.hidden_dropout, self.training)


class BloomModel(nn.Module):
    def __init__(self, vocab=101, hidden_size=32, n_layer=2, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.word_embeddings = nn.Embedding(vocab, hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(hidden_size)
        self.h = nn.ModuleList([BloomBlock(hidden_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        attention_mask = torch.ones_like(input_ids)
        alibi = build_alibi_tensor(attention_mask, self.n_head, torch.float32)
        causal_mask = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
        causal_mask = causal_mask[None, None].expand(batch_size, 1, seq_length, seq_length)
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask)
        return self.lm_head(self.ln_f(hidden_states))


if __name__ == "__main__":
    train(BloomModel(), 101, 16)
