"""Train a recurrent model written as a Python loop over nn.LSTMCell (a common form, and a slow one).

    python examples/lstm_train.py                      # 20 steps, small sizes, cuda if available
    python examples/lstm_train.py --input 985 --hidden 985 --batch 4 --seq 1000   # hfai's LSTM benchmark
    opadvisor profile examples/lstm_train.py && opadvisor suggest                 # what opadvisor finds

The model reads a noisy multi-channel signal one time step at a time (`h, c = self.cell(x[t], (h, c))`)
and predicts the next step's values from each hidden state: a next-step regression, trained with Adam.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class NextStep(nn.Module):
    def __init__(self, input_size, hidden):
        super().__init__()
        self.cell = nn.LSTMCell(input_size, hidden)
        self.head = nn.Linear(hidden, input_size)

    def forward(self, x):  # x: [seq, batch, input]
        h = x.new_zeros(x.size(1), self.cell.hidden_size)
        c = x.new_zeros(x.size(1), self.cell.hidden_size)
        outputs = []
        for t in range(x.size(0)):
            h, c = self.cell(x[t], (h, c))
            outputs.append(h)
        return self.head(torch.stack(outputs))


def signal(args, generator: torch.Generator) -> torch.Tensor:
    """[seq + 1, batch, input]: sines of random frequency and phase per channel, plus noise."""
    t = torch.arange(args.seq + 1, dtype=torch.float32)[:, None, None]
    freq = torch.rand(1, args.batch, args.input, generator=generator) * 0.2 + 0.01
    phase = torch.rand(1, args.batch, args.input, generator=generator) * 6.28
    noise = torch.randn(args.seq + 1, args.batch, args.input, generator=generator) * 0.05
    return torch.sin(t * freq + phase) + noise


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=50)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = NextStep(args.input, args.hidden).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed)

    model.train()
    for step in range(1, args.steps + 1):
        series = signal(args, data_gen).to(device)
        x, y = series[:-1], series[1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = F.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
