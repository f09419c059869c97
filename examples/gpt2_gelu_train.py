"""Train a GPT-2-style language model whose GELU is written by hand, on a synthetic token stream.

    python examples/gpt2_gelu_train.py                 # 20 steps, small sizes, cuda if available
    opadvisor profile examples/gpt2_gelu_train.py      # what opadvisor finds in it

    # GPT-2 small (124M parameters) at the context it was trained with:
    python examples/gpt2_gelu_train.py --hidden 768 --layers 12 --heads 12 --seq 1024 --batch 8

Plain PyTorch the way GPT-2 ports are usually written: the tanh approximation of GELU spelled out as in
the original TensorFlow code, causal attention by hand with a registered lower-triangular mask, pre-norm
residual blocks, the token embedding tied to the 50257-wide LM head, bf16 autocast, plain AdamW.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def new_gelu(x):
    """GELU, the tanh approximation used by GPT-2 (Hendrycks & Gimpel, 2016)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, heads, seq, dropout):
        super().__init__()
        assert hidden % heads == 0
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = heads
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = new_gelu(x)
        x = self.c_proj(x)
        return self.dropout(x)


class Block(nn.Module):
    def __init__(self, hidden, heads, seq, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, seq, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, seq, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(hidden, heads, seq, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of the residual projections (GPT-2 paper)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="bf16 = autocast (default on cuda); fp32 is the default on cpu",
    )
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)

    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq, args.dropout).to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    # A synthetic token stream with structure to learn: each token is its predecessor plus a small step.
    # Batches are sampled with their own generator, so they do not depend on the model's random draws.
    data_gen = torch.Generator().manual_seed(args.seed)
    vocab_used = min(args.vocab, 1000)
    increments = torch.randint(1, 4, (args.batch * args.seq * 16,), generator=data_gen)
    data = torch.cumsum(increments, dim=0) % vocab_used

    model.train()
    for step in range(1, args.steps + 1):
        ix = torch.randint(len(data) - args.seq - 1, (args.batch,), generator=data_gen)
        x = torch.stack([data[i : i + args.seq] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + args.seq] for i in ix])
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
