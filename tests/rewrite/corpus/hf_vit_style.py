"""A HuggingFace ViT/ALBERT-style encoder: scores divided by sqrt(head size), F.softmax, attention dropout;
ViTOutput's `dropout(hidden); hidden + input_tensor`; ALBERT's named dropout result fed to the LayerNorm
of its sum with the residual."""

import math

import torch
from _train import train
from torch import nn


class ViTSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, dropout=0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.output_dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=1e-12)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(self.query(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.transpose(2, 1).flatten(2)

        projected_context_layer = self.dense(context_layer)
        projected_context_layer_dropout = self.output_dropout(projected_context_layer)
        layernormed_context_layer = self.LayerNorm(hidden_states + projected_context_layer_dropout)
        return layernormed_context_layer


class ViTOutput(nn.Module):
    def __init__(self, hidden_size=32, intermediate_size=64, dropout=0.1):
        super().__init__()
        self.dense = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = hidden_states + input_tensor
        return hidden_states


class ViTLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = ViTSelfAttention()
        self.layernorm_after = nn.LayerNorm(32, eps=1e-12)
        self.intermediate = nn.Linear(32, 64)
        self.output = ViTOutput()

    def forward(self, hidden_states):
        attention_output = self.attention(hidden_states)
        layer_output = self.layernorm_after(attention_output)
        layer_output = nn.functional.gelu(self.intermediate(layer_output))
        return self.output(layer_output, attention_output)


class ViTModel(nn.Module):
    def __init__(self, vocab=101, layers=2):
        super().__init__()
        self.patch_embeddings = nn.Embedding(vocab, 32)
        self.position_embeddings = nn.Parameter(torch.randn(1, 16, 32) * 0.02)
        self.dropout = nn.Dropout(0.1)
        self.layer = nn.ModuleList([ViTLayer() for _ in range(layers)])
        self.layernorm = nn.LayerNorm(32, eps=1e-12)
        self.classifier = nn.Linear(32, vocab)

    def forward(self, ids):
        embeddings = self.patch_embeddings(ids) + self.position_embeddings
        hidden_states = self.dropout(embeddings)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states)
        return self.classifier(self.layernorm(hidden_states))


if __name__ == "__main__":
    train(ViTModel(), 101, 16)
