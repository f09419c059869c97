import argparse
import sys

import torch

from .model import Tiny


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    # how it was run, for the tests: package context, sys.path[0], argv[0]
    print(f"package={__package__} spec={__spec__.name} path0={sys.path[0]} argv0={sys.argv[0]}")
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        loss = model(torch.randn(4, 8))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
