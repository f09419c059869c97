"""A RoBERTa/ELECTRA-style encoder as transformers 4.48+ writes it: a module-level eager attention function
(scores times `scaling`, the mask sliced to the key length, a float32 softmax cast back to the query's
dtype, functional dropout with the module's training flag), the extended mask built by a helper, and the
self-output residual written inside the LayerNorm call."""

import torch
from _train import train
from torch import nn


class Config:
    vocab_size = 101
    hidden_size = 32
    num_attention_heads = 4
    intermediate_size = 64
    num_hidden_layers = 2
    hidden_dropout_prob = 0.1
    attention_probs_dropout_prob = 0.1
    layer_norm_eps = 1e-5


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, head_mask=None):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key.shape[-2]]
        attn_weights = attn_weights + causal_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    if head_mask is not None:
        attn_weights = attn_weights * head_mask.view(1, -1, 1, 1)

    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def get_extended_attention_mask(attention_mask, dtype):
    extended = attention_mask[:, None, None, :].to(dtype=dtype)
    return (1.0 - extended) * torch.finfo(dtype).min


class RobertaSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.scaling = self.attention_head_size**-0.5
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_prob = config.attention_probs_dropout_prob

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query_states = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.value(hidden_states).view(hidden_shape).transpose(1, 2)

        attn_output, _ = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout_prob,
            scaling=self.scaling,
        )
        return attn_output.reshape(*input_shape, -1).contiguous()


class RobertaSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.LayerNorm(self.dropout(hidden_states) + input_tensor)
        return hidden_states


class RobertaOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class RobertaLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attention = RobertaSelfAttention(config)
        self.attention_output = RobertaSelfOutput(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = RobertaOutput(config)

    def forward(self, hidden_states, attention_mask):
        self_output = self.self_attention(hidden_states, attention_mask)
        attention_output = self.attention_output(self_output, hidden_states)
        intermediate_output = nn.functional.gelu(self.intermediate(attention_output))
        return self.output(intermediate_output, attention_output)


class RobertaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer = nn.ModuleList([RobertaLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids):
        attention_mask = torch.ones_like(input_ids)
        attention_mask[:, -3:] = 0
        extended = get_extended_attention_mask(attention_mask, torch.float32)
        hidden_states = self.LayerNorm(self.word_embeddings(input_ids))
        for layer in self.layer:
            hidden_states = layer(hidden_states, extended)
        return hidden_states


if __name__ == "__main__":
    config = Config()
    train(
        RobertaModel(config), config.vocab_size, 16, lm_head=nn.Linear(config.hidden_size, config.vocab_size)
    )
