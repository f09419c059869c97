"""A compiled model with four planted torch.compile problems, as people write them (issue 33).

Three graph breaks in the forward (a tensor read as a number, a print of a tensor, an `if` on a tensor)
and a sequence length that changes from step to step (a recompile). `--fullgraph` compiles with
`fullgraph=True` (it fails while a break is left); `--steps N` trains N steps and prints each loss.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        y = self.down(F.gelu(self.up(h)))
        scale = y.abs().mean().item()  # expect: scalar_read
        print(y.std())  # expect: print
        if y.max() > 0:  # expect: tensor_branch
            y = y * 0.5
        return self.head(y + h * scale)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fullgraph", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyLM()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=args.fullgraph)  # expect: recompile
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        seq = 12 + step % 3  # a sequence length that changes every step
        ids = torch.randint(0, 64, (4, seq))
        logits = compiled(ids)
        loss = F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
