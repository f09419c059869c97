"""A small encoder written by hand: masked softmax attention and the tanh GELU spelled out."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Layer(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        probs = self.drop(probs)
        y = (probs @ v).transpose(1, 2).reshape(b, t, c)
        x = self.norm1(x + self.out(y))
        return self.norm2(x + self.fc2(gelu(self.fc1(x))))


class Encoder(nn.Module):
    def __init__(self, vocab=100, hidden=32, heads=2, layers=1, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, dropout) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, mask):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)
