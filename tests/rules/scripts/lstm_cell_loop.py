"""A sequence model written as a loop over nn.LSTMCell (rnn_cell_loop), and a GRUCell decoder whose loop
feeds its own output back (a loop that does more than step the cell: found, left alone by the rewrite)."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tagger(nn.Module):
    def __init__(self, vocab=50, dim=16, hidden=24, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.LSTMCell(dim, hidden)
        self.head = nn.Linear(hidden, classes)
        self.hidden = hidden

    def forward(self, tokens):  # tokens: [seq, batch]
        x = self.embed(tokens)
        h = x.new_zeros(x.size(1), self.hidden)
        c = x.new_zeros(x.size(1), self.hidden)
        outputs = []
        for t in range(x.size(0)):  # expect: rnn_cell_loop start
            h, c = self.cell(x[t], (h, c))
            outputs.append(h)  # expect: rnn_cell_loop end
        return self.head(torch.stack(outputs)), h


class Decoder(nn.Module):
    """Greedy decoding: each step's output is the next step's input, so the loop cannot be one call."""

    def __init__(self, hidden=24, classes=5):
        super().__init__()
        self.cell = nn.GRUCell(classes, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, h, steps):
        y = h.new_zeros(h.size(0), self.out.out_features)
        outs = []
        for _ in range(steps):  # expect: gru_feedback start
            h = self.cell(y, h)
            y = self.out(h)
            outs.append(y)  # expect: gru_feedback end
        return torch.stack(outs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--batch", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Tagger().to(device)
    decoder = Decoder().to(device)
    opt = torch.optim.SGD([*model.parameters(), *decoder.parameters()], lr=0.1)
    for _ in range(args.steps):
        tokens = torch.randint(0, 50, (args.seq, args.batch), device=device)
        labels = torch.randint(0, 5, (args.seq, args.batch), device=device)
        logits, h = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = loss + decoder(h, 6).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
