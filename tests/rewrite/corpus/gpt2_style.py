"""A GPT-2/GPT-Neo-style decoder as transformers 4.x wrote it: Conv1D projections, the scores divided by a
torch.full scalar, the causal buffer applied with torch.where and a finfo.min tensor, the padding mask
added after, softmax cast back to v's dtype, attention dropout; residual dropout inside the attention
module (its add in the block)."""

import torch
from _train import train
from torch import nn


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, max_positions=64, pdrop=0.1):
        super().__init__()
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.c_attn = Conv1D(3 * embed_dim, embed_dim)
        self.c_proj = Conv1D(embed_dim, embed_dim)
        self.attn_dropout = nn.Dropout(pdrop)
        self.resid_dropout = nn.Dropout(pdrop)

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
        )

        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)

        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.embed_dim,))

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)
        attn_output, _ = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output)
        attn_output = self.c_proj(attn_output)
        return self.resid_dropout(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, embed_dim=32, inner=128, pdrop=0.1):
        super().__init__()
        self.c_fc = Conv1D(inner, embed_dim)
        self.c_proj = Conv1D(embed_dim, inner)
        self.dropout = nn.Dropout(pdrop)

    def forward(self, hidden_states):
        hidden_states = nn.functional.gelu(self.c_fc(hidden_states), approximate="tanh")
        hidden_states = self.c_proj(hidden_states)
        return self.dropout(hidden_states)


class GPT2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(32, eps=1e-5)
        self.attn = GPT2Attention()
        self.ln_2 = nn.LayerNorm(32, eps=1e-5)
        self.mlp = GPT2MLP()

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        attn_output = self.attn(self.ln_1(hidden_states), attention_mask)
        hidden_states = attn_output + residual
        residual = hidden_states
        feed_forward_hidden_states = self.mlp(self.ln_2(hidden_states))
        return residual + feed_forward_hidden_states


class GPT2Model(nn.Module):
    def __init__(self, vocab=101, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.wpe = nn.Embedding(64, 32)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList([GPT2Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, vocab, bias=False)

    def forward(self, input_ids):
        keep = torch.ones_like(input_ids, dtype=torch.float32)
        keep[:, -2:] = 0.0
        attention_mask = (1.0 - keep[:, None, None, :]) * torch.finfo(torch.float32).min
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask)
        return self.lm_head(self.ln_f(hidden_states))


if __name__ == "__main__":
    train(GPT2Model(), 101, 16)
