"""A Megatron-LM-style layer (sequence-first [s, b, h]): scores by torch.baddbmm into a preallocated buffer
with beta=0 and alpha=1/norm_factor, viewed to 4-D, the bool mask filled in place with -10000.0, softmax,
dropout, bmm with v; projections that return their bias unapplied and a bias_dropout_add function."""

import math

import torch
from _train import train
from torch import nn


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def bias_dropout_add(x, bias, residual, prob, training):
    out = torch.nn.functional.dropout(x + bias, p=prob, training=training)
    out = residual + out
    return out


class RowParallelLinear(nn.Module):
    """A linear layer that hands its bias back to the caller (skip_bias_add), as Megatron's does."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


class CoreAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, attention_dropout=0.1):
        super().__init__()
        self.hidden_size_per_attention_head = hidden // heads
        self.num_attention_heads_per_partition = heads
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.attention_dropout = nn.Dropout(attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)
        matmul_input_buffer = torch.empty(
            output_size[0] * output_size[1],
            output_size[2],
            output_size[3],
            dtype=query_layer.dtype,
            device=query_layer.device,
        )
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query_layer.transpose(0, 1),
            key_layer.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )
        attention_scores = matmul_result.view(*output_size)

        attention_scores = attention_mask_func(attention_scores, attention_mask)
        attention_probs = torch.nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.attention_dropout(attention_probs)

        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (
            self.hidden_size_per_attention_head * self.num_attention_heads_per_partition,
        )
        return context_layer.view(*new_context_layer_shape)


class ParallelAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention(hidden, heads)
        self.dense = RowParallelLinear(hidden, hidden)

    def forward(self, hidden_states, attention_mask):
        mixed_x_layer = self.query_key_value(hidden_states)
        new_tensor_shape = mixed_x_layer.size()[:-1] + (self.heads, 3 * hidden_states.size(-1) // self.heads)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        query_layer, key_layer, value_layer = torch.chunk(mixed_x_layer, 3, dim=-1)
        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden=32, ffn=64, hidden_dropout=0.1):
        super().__init__()
        self.hidden_dropout = hidden_dropout
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.self_attention = ParallelAttention(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.dense_h_to_4h = nn.Linear(hidden, ffn)
        self.dense_4h_to_h = RowParallelLinear(ffn, hidden)

    def forward(self, hidden_states, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output, attention_bias = self.self_attention(layernorm_output, attention_mask)
        residual = hidden_states
        layernorm_input = bias_dropout_add(
            attention_output, attention_bias.expand_as(residual), residual, self.hidden_dropout, self.training
        )
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        mlp_output, mlp_bias = self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(layernorm_output)))
        residual = layernorm_input
        output = bias_dropout_add(
            mlp_output, mlp_bias.expand_as(residual), residual, self.hidden_dropout, self.training
        )
        return output


class GPTModel(nn.Module):
    def __init__(self, vocab=101, hidden=32, layers=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([ParallelTransformerLayer(hidden) for _ in range(layers)])
        self.final_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        seq = input_ids.shape[1]
        attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        hidden_states = self.word_embeddings(input_ids).transpose(0, 1).contiguous()
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.output_layer(self.final_layernorm(hidden_states)).transpose(0, 1)


if __name__ == "__main__":
    train(GPTModel(), 101, 16)
