"""Three steps, then Ctrl-C: SIGINT to this process (argv[1] == "signal") or KeyboardInterrupt raised."""

import os
import signal
import sys
import time

import torch

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(100):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    if i == 2:
        if sys.argv[1:] == ["signal"]:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the signal interrupts this
        raise KeyboardInterrupt
