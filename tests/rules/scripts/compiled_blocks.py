"""A small GPT compiled whole: six identical blocks, each traced and compiled again (issue 33).

`regional_compile` finds it at the `torch.compile` call; its fix compiles each block on its own, one graph
for all six. `--steps N` trains N steps and prints each loss.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.blocks:
            h = layer(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend="aot_eager")  # expect: regional_compile
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        ids = torch.randint(0, 64, (4, 16))
        loss = F.cross_entropy(compiled(ids).reshape(-1, 64), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
