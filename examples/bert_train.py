"""Train a small BERT/DeBERTa-style encoder with a masked-language-model loss on synthetic data.

    python examples/bert_train.py                      # 20 steps, small sizes, cuda if available
    opadvisor profile examples/bert_train.py           # what opadvisor finds in it

Plain PyTorch, written the way such models usually are: attention by hand with a padding mask
(DeBERTa's XSoftmax: mask -> softmax -> mask), post-norm residual blocks, a 30522-wide LM head,
AdamW, a DataLoader with default settings and `loss.item()` every step.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, S, _ = x.shape
        q = self.query(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        probs = probs.masked_fill(~mask, 0.0)
        probs = self.attn_dropout(probs)
        ctx = probs @ v
        return ctx.transpose(1, 2).reshape(B, S, self.heads * self.head_dim)


class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.attention = SelfAttention(hidden, heads, dropout)
        self.out_proj = nn.Linear(hidden, hidden)
        self.out_dropout = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn_in = nn.Linear(hidden, 4 * hidden)
        self.ffn_out = nn.Linear(4 * hidden, hidden)
        self.ffn_dropout = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x, mask):
        ctx = self.attention(x, mask)
        x = self.norm1(x + self.out_dropout(self.out_proj(ctx)))
        x = self.norm2(x + self.ffn_dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))
        return x


class BertForMaskedLM(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, seq, dropout):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.emb_norm = nn.LayerNorm(hidden)
        self.emb_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads, dropout) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, lengths):
        B, S = input_ids.shape
        positions = torch.arange(S, device=input_ids.device)
        mask = (positions[None, :] < lengths[:, None]).view(B, 1, 1, S)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        x = self.emb_dropout(self.emb_norm(x))
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(x)


def make_dataset(args, vocab_used, mask_id, generator):
    """Synthetic MLM data: token ids, per-sequence lengths, and labels (-100 where nothing is predicted)."""
    n = args.batch * 16
    tokens = torch.randint(1, vocab_used, (n, args.seq), generator=generator)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (n,), generator=generator)
    valid = torch.arange(args.seq)[None, :] < lengths[:, None]
    tokens[~valid] = 0  # padding
    predict = (torch.rand(n, args.seq, generator=generator) < 0.15) & valid
    labels = torch.where(predict, tokens, torch.full_like(tokens, -100))
    input_ids = torch.where(predict, torch.full_like(tokens, mask_id), tokens)
    return TensorDataset(input_ids, lengths, labels)


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
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="bf16 = autocast (default on cuda); fp32 is the default on cpu",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)

    model = BertForMaskedLM(args.vocab, args.hidden, args.layers, args.heads, args.seq, args.dropout)
    model = model.to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # The data has its own generator, so the batches do not depend on how the model draws random numbers.
    data_gen = torch.Generator().manual_seed(args.seed)
    vocab_used = min(args.vocab - 1, 1000)  # the last id used is the [MASK] token
    dataset = make_dataset(args, vocab_used, mask_id=vocab_used, generator=data_gen)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, generator=data_gen)

    model.train()
    step = 0
    while step < args.steps:
        for input_ids, lengths, labels in loader:
            input_ids = input_ids.to(device)
            lengths = lengths.to(device)
            labels = labels.to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = model(input_ids, lengths)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            print(f"step {step} loss {loss.item():.6f}")
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
