"""A GPT-2-sized model compiled whole, with the four torch.compile problems people plant without knowing
(issue 33's GPU row; benchmarks/compile_gpt.py copies it as the user's train.py and runs opadvisor on it).

In the forward: a tensor read as a number (`.item()`), a `print` of a tensor, an `if` on a tensor; in the
loop: a sequence length that changes from step to step. bf16 autocast, AdamW. Prints each step's loss and
time (`step N loss L ms T`); `--tiny` is a CPU-sized model for a smoke run.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        scale = x.float().pow(2).mean().rsqrt().item()  # a number read from the GPU
        print(x.std())  # a print of a tensor, left from debugging
        if x.abs().max() > 100:  # a Python branch on a tensor's value
            x = x.clamp(-100, 100)
        x = x * scale
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        vocab, d, layers, heads, batch, context = 512, 64, 4, 4, 4, 64
    else:
        vocab, d, layers, heads, batch, context = 50304, 768, 12, 12, 8, 1024
    model = GPT(vocab, d, layers, heads, context).to(device)
    compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (batch, context + 1), device=device)
    for step in range(args.steps):
        seq = context - (context // 8) * (step % 3)  # the batch's length changes every step
        ids, labels = data[:, :seq], data[:, 1 : seq + 1]
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = compiled(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"step {step} loss {loss.item():.6f} ms {(time.perf_counter() - start) * 1000:.2f}")


if __name__ == "__main__":
    main()
