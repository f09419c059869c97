"""Train a tiny BERT with HuggingFace's Trainer, with opadvisor's callback recording a window of steps.

    python examples/hf_trainer.py                    # 12 steps; the run lands in .opadvisor/runs/<id>/
    opadvisor suggest                                # then, as after `opadvisor profile`
    opadvisor report -o report.html

The model is built from a configuration object (nothing is downloaded) and trains on synthetic tokens.
"""

import argparse

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

from opadvisor.integrations import OpadvisorCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12, help="training steps")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=3, help="steps before opadvisor's window")
    parser.add_argument("--record", type=int, default=5, help="steps opadvisor records")
    parser.add_argument("--out", default="trainer_output", help="the Trainer's output folder")
    args = parser.parse_args()

    config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=RandomTokens(args.steps * args.batch, args.seq, args.vocab, seed=0),
        callbacks=[OpadvisorCallback(warmup=args.warmup, steps=args.record)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
