"""Two recurrent layers for cudnn_rnn: an nn.LSTM whose recurrent weight was re-initialised through `.data`
after it was built (its weights are no longer one buffer: nn.LSTM re-packs a replaced Parameter by itself,
not a replaced `.data`), and an nn.GRU left as built (float32, packed)."""

import argparse

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim=32, hidden=48):
        super().__init__()
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.lstm(x)  # expect: not_flat
        out, _ = self.gru(out)  # expect: float32
        return self.head(out[:, -1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Model().to(device)
    recurrent = torch.empty_like(model.lstm.weight_hh_l0)
    nn.init.orthogonal_(recurrent)
    model.lstm.weight_hh_l0.data = recurrent  # the same Parameter, its data now outside the packed buffer
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        x = torch.randn(8, 50, 32, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
