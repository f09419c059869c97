"""Two ranks (gloo, CPU) train a tiny DDP model and record opadvisor's window with WindowRecorder, the
framework-neutral part of the Trainer callbacks. Run through torchrun."""

import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from opadvisor.profile.recorder import WindowRecorder


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = WindowRecorder(warmup=1, steps=2)
    recorder.start()
    for _ in range(5):
        loss = model(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        recorder.step()
    recorder.stop()
    print(f"rank {dist.get_rank()} run {recorder.outcome.run_dir}")
    del model, opt, loss
    dist.destroy_process_group()
    # torch's gloo group, left to the interpreter's exit, aborts the process about one run in four under
    # load ("terminate called without an active exception", with or without opadvisor): collect it now.
    gc.collect()


if __name__ == "__main__":
    main()
