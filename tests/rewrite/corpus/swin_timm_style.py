"""A Swin-style window attention as later timm releases write it: scale on q, the relative position bias
from a helper method, the shift mask added to a 5-D view of the scores under `if mask is not None:` and
the view undone there, one softmax after the branch (nn.Softmax attribute), attention dropout."""

import torch
import torch.nn as nn
from _train import train


class WindowAttention(nn.Module):
    def __init__(self, dim, window, num_heads, attn_drop=0.1, proj_drop=0.1):
        super().__init__()
        self.dim = dim
        self.window = window
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros(2 * window - 1, num_heads))
        coords = torch.arange(window)
        relative = coords[:, None] - coords[None, :] + window - 1
        self.register_buffer("relative_position_index", relative)
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.softmax = nn.Softmax(dim=-1)

    def _get_rel_pos_bias(self):
        relative_position_bias = self.relative_position_bias_table[
            self.relative_position_index.view(-1)
        ].view(self.window, self.window, -1)
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()
        return relative_position_bias.unsqueeze(0)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)

        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class SwinBlock(nn.Module):
    def __init__(self, dim, window, heads):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.Dropout(0.1))

    def forward(self, x):
        B, L, C = x.shape
        windows = self.norm1(x).view(B * L // self.window, self.window, C)
        shift = torch.zeros(L // self.window, self.window, self.window)
        shift[-1, :, -1] = -100.0
        attn_windows = self.attn(windows, shift)
        x = x + attn_windows.view(B, L, C)
        x = x + self.mlp(self.norm2(x))
        return x


class SwinText(nn.Module):
    def __init__(self, vocab=101, dim=32, window=4, heads=4, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([SwinBlock(dim, window, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


if __name__ == "__main__":
    train(SwinText(), 101, 16)
