"""A training loop that zeroes its gradients instead of dropping them: `zero_grad(set_to_none=False)` on
an SGD optimizer with momentum (`--foreach`: built with foreach=True, which zeroes with one
`_foreach_zero_`). `train(steps)` returns the losses, the last gradients and the parameters,
for the test that compares the program before and after the fix."""

import sys

import torch


def train(steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.SGD(
        model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.01, foreach="--foreach" in sys.argv
    )
    x = torch.randn(16, 32)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)  # expect: zero_grad_set_to_none
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.grad for p in model.parameters()], list(model.parameters())


if __name__ == "__main__":
    train(8)
