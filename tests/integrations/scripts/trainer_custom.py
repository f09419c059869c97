"""A model written in the user's own code (a hand-written masked attention), trained by HF's Trainer with
opadvisor's callback: the run it records names lines of this file, so apply and verify can work on it."""

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from opadvisor.integrations import OpadvisorCallback


class TinyEncoder(nn.Module):
    def __init__(self, vocab=101, hidden=32, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask, labels):
        x = self.embed(input_ids)
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = attention_mask.bool().view(B, 1, 1, S)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        probs = probs.masked_fill(~mask, 0.0)
        ctx = (probs @ v).transpose(1, 2).reshape(B, S, H)
        logits = self.head(x + self.out(ctx))
        return {"loss": F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1)), "logits": logits}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq=16, vocab=101):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i]}


def main(steps=6, warmup=1, record=2, stop=False):
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir="trainer_output",
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    callback = OpadvisorCallback(warmup=warmup, steps=record, stop_after_window=stop)
    trainer = Trainer(model=TinyEncoder(), args=args, train_dataset=Tokens(steps * 4), callbacks=[callback])
    trainer.train()
    print(f"global steps {trainer.state.global_step}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]), stop="--stop" in sys.argv)
