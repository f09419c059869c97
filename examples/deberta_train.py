"""Fine-tune a DeBERTa-v3-style encoder for sequence classification on synthetic, padded batches.

    python examples/deberta_train.py                   # 20 steps, small sizes, cuda if available
    opadvisor profile examples/deberta_train.py        # what opadvisor finds in it

    # DeBERTa-v3-base sizes (hidden 768, 12 layers, 256 position buckets, 128100-token vocabulary):
    python examples/deberta_train.py --hidden 768 --layers 12 --heads 12 --seq 512 --batch 8 \\
        --vocab 128100 --position-buckets 256

Written the way DeBERTa ports are: disentangled attention (content->position and position->content
scores from shared relative-position embeddings, gathered by log-bucketed relative positions), the masked
softmax as an autograd Function (XSoftmax), and the model's own dropout, which keeps a bool mask and
applies it with masked_fill, as an autograd Function (XDropout, used through StableDropout). bf16
autocast, plain AdamW, `loss.item()` every step.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class XSoftmax(torch.autograd.Function):
    """Softmax over `dim` where `mask` is 0: masked scores get the dtype's lowest value, then probability 0."""

    @staticmethod
    def forward(ctx, input, mask, dim):
        ctx.dim = dim
        rmask = ~(mask.to(torch.bool))
        output = input.masked_fill(rmask, torch.finfo(input.dtype).min)
        output = torch.softmax(output, ctx.dim)
        output.masked_fill_(rmask, 0)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        grad_input = torch._softmax_backward_data(grad_output, output, ctx.dim, output.dtype)
        return grad_input, None, None


class XDropout(torch.autograd.Function):
    """Dropout that keeps the dropped positions as a bool mask and applies it with masked_fill."""

    @staticmethod
    def forward(ctx, input, drop_prob):
        mask = (1 - torch.empty_like(input).bernoulli_(1 - drop_prob)).to(torch.bool)
        ctx.scale = 1.0 / (1 - drop_prob)
        ctx.save_for_backward(mask)
        return input.masked_fill(mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        return grad_output.masked_fill(mask, 0) * ctx.scale, None


class StableDropout(nn.Module):
    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.training and self.drop_prob > 0:
            return XDropout.apply(x, self.drop_prob)
        return x


def make_log_bucket_position(relative_pos, bucket_size, max_position):
    """Relative distances beyond bucket_size // 2 share log-spaced buckets (DeBERTa-v2's position buckets)."""
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative_pos < mid) & (relative_pos > -mid),
        torch.tensor(mid - 1).type_as(relative_pos),
        torch.abs(relative_pos),
    )
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign).long()


def build_relative_position(query_size, key_size, bucket_size, max_position, device):
    q_ids = torch.arange(query_size, device=device)
    k_ids = torch.arange(key_size, device=device)
    rel_pos_ids = q_ids[:, None] - k_ids[None, :]
    if bucket_size > 0:
        rel_pos_ids = make_log_bucket_position(rel_pos_ids, bucket_size, max_position)
    return rel_pos_ids.unsqueeze(0)  # [1, query, key]


class DisentangledSelfAttention(nn.Module):
    def __init__(self, hidden, heads, att_span, dropout):
        super().__init__()
        self.num_attention_heads = heads
        self.query_proj = nn.Linear(hidden, hidden)
        self.key_proj = nn.Linear(hidden, hidden)
        self.value_proj = nn.Linear(hidden, hidden)
        self.att_span = att_span
        self.pos_dropout = StableDropout(dropout)
        self.dropout = StableDropout(dropout)

    def transpose_for_scores(self, x):
        x = x.view(x.size()[:-1] + (self.num_attention_heads, -1))
        return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))

    def forward(self, hidden_states, attention_mask, relative_pos, rel_embeddings):
        query_layer = self.transpose_for_scores(self.query_proj(hidden_states))
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states))
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states))

        scale_factor = 3  # content->content, content->position, position->content
        scale = math.sqrt(query_layer.size(-1) * scale_factor)
        attention_scores = torch.bmm(query_layer, key_layer.transpose(-1, -2)) / scale
        rel_embeddings = self.pos_dropout(rel_embeddings)
        rel_att = self.disentangled_attention_bias(
            query_layer, key_layer, relative_pos, rel_embeddings, scale
        )
        attention_scores = attention_scores + rel_att
        attention_scores = attention_scores.view(
            -1, self.num_attention_heads, attention_scores.size(-2), attention_scores.size(-1)
        )

        attention_probs = XSoftmax.apply(attention_scores, attention_mask, -1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.bmm(
            attention_probs.view(-1, attention_probs.size(-2), attention_probs.size(-1)), value_layer
        )
        context_layer = (
            context_layer.view(-1, self.num_attention_heads, context_layer.size(-2), context_layer.size(-1))
            .permute(0, 2, 1, 3)
            .contiguous()
        )
        return context_layer.view(context_layer.size()[:-2] + (-1,))

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale):
        att_span = self.att_span
        rel_embeddings = rel_embeddings[0 : att_span * 2, :].unsqueeze(0)
        # DeBERTa-v3 shares the content projections with the relative-position embeddings
        repeat = query_layer.size(0) // self.num_attention_heads
        pos_query_layer = self.transpose_for_scores(self.query_proj(rel_embeddings)).repeat(repeat, 1, 1)
        pos_key_layer = self.transpose_for_scores(self.key_proj(rel_embeddings)).repeat(repeat, 1, 1)

        # content -> position
        c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
        c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
        c2p_att = torch.gather(
            c2p_att,
            dim=-1,
            index=c2p_pos.squeeze(0).expand(
                [query_layer.size(0), query_layer.size(1), relative_pos.size(-1)]
            ),
        )
        score = c2p_att / scale

        # position -> content
        p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
        p2c_pos = torch.clamp(-relative_pos + att_span, 0, att_span * 2 - 1)
        p2c_att = torch.gather(
            p2c_att,
            dim=-1,
            index=p2c_pos.squeeze(0).expand([query_layer.size(0), key_layer.size(-2), key_layer.size(-2)]),
        ).transpose(-1, -2)
        score += p2c_att / scale
        return score


class SelfOutput(nn.Module):
    """dense -> dropout -> LayerNorm(+ residual): after the attention (in = hidden) and after the MLP."""

    def __init__(self, in_features, hidden, dropout):
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-7)
        self.dropout = StableDropout(dropout)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


class Layer(nn.Module):
    def __init__(self, hidden, heads, att_span, dropout):
        super().__init__()
        self.attention = DisentangledSelfAttention(hidden, heads, att_span, dropout)
        self.attention_output = SelfOutput(hidden, hidden, dropout)
        self.intermediate = nn.Linear(hidden, 4 * hidden)
        self.output = SelfOutput(4 * hidden, hidden, dropout)

    def forward(self, hidden_states, attention_mask, relative_pos, rel_embeddings):
        attention = self.attention(hidden_states, attention_mask, relative_pos, rel_embeddings)
        attention_output = self.attention_output(attention, hidden_states)
        intermediate = F.gelu(self.intermediate(attention_output))
        return self.output(intermediate, attention_output)


class Encoder(nn.Module):
    def __init__(self, hidden, layers, heads, position_buckets, max_relative_positions, dropout):
        super().__init__()
        self.position_buckets = position_buckets
        self.max_relative_positions = max_relative_positions
        att_span = position_buckets if position_buckets > 0 else max_relative_positions
        self.rel_embeddings = nn.Embedding(att_span * 2, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-7)
        self.layer = nn.ModuleList([Layer(hidden, heads, att_span, dropout) for _ in range(layers)])

    def forward(self, hidden_states, input_mask):
        # [B, S] padding mask -> [B, 1, S, S]: a score counts when both its query and its key are tokens
        extended = input_mask.unsqueeze(1).unsqueeze(2)
        attention_mask = (extended * extended.squeeze(-2).unsqueeze(-1)).byte()
        seq = hidden_states.size(1)
        relative_pos = build_relative_position(
            seq, seq, self.position_buckets, self.max_relative_positions, hidden_states.device
        )
        rel_embeddings = self.LayerNorm(self.rel_embeddings.weight)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, relative_pos, rel_embeddings)
        return hidden_states


class DebertaForSequenceClassification(nn.Module):
    def __init__(
        self, vocab, hidden, layers, heads, position_buckets, max_relative_positions, labels, dropout
    ):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.embeddings_norm = nn.LayerNorm(hidden, eps=1e-7)
        self.embeddings_dropout = StableDropout(dropout)
        self.encoder = Encoder(hidden, layers, heads, position_buckets, max_relative_positions, dropout)
        self.pooler = nn.Linear(hidden, hidden)
        self.pooler_dropout = StableDropout(dropout)
        self.classifier = nn.Linear(hidden, labels)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, input_mask):
        embeddings = self.embeddings_norm(self.word_embeddings(input_ids))
        embeddings = embeddings * input_mask.unsqueeze(2).to(embeddings.dtype)
        hidden_states = self.encoder(self.embeddings_dropout(embeddings), input_mask)
        # pool the first token, as DeBERTa's ContextPooler does
        pooled = F.gelu(self.pooler(self.pooler_dropout(hidden_states[:, 0])))
        return self.classifier(self.pooler_dropout(pooled))


def synthetic_batch(args, vocab_used, generator):
    """Padded token batches; the label is whether token 1 occurs more often than token 2."""
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=generator)
    ids = torch.randint(1, vocab_used, (args.batch, args.seq), generator=generator)
    input_mask = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
    ids = ids * input_mask
    labels = ((ids == 1).sum(1) > (ids == 2).sum(1)).long()
    return ids, input_mask, labels


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
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--position-buckets", type=int, default=8)
    parser.add_argument("--max-relative-positions", type=int, default=None, help="default: --seq")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="bf16 = autocast (default on cuda); fp32 is the default on cpu",
    )
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)

    model = DebertaForSequenceClassification(
        args.vocab,
        args.hidden,
        args.layers,
        args.heads,
        args.position_buckets,
        args.max_relative_positions or args.seq,
        2,
        args.dropout,
    ).to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    data_gen = torch.Generator().manual_seed(args.seed)
    vocab_used = min(args.vocab, 1000)
    model.train()
    for step in range(1, args.steps + 1):
        input_ids, input_mask, labels = (t.to(device) for t in synthetic_batch(args, vocab_used, data_gen))
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(input_ids, input_mask)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
