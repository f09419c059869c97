"""`opadvisor.patch(model)` / `opadvisor.unpatch(model)`: fused forwards for modules that live in libraries.

Most models people train are built from an installed package's classes (transformers' BERT and GPT-2,
`nn.MultiheadAttention`, `nn.TransformerEncoderLayer`), whose source opadvisor must not edit. `patch`
walks the model and replaces, **per instance**, the forward of each module it recognises with a fused
equivalent built from `opadvisor.kernels` and PyTorch; `unpatch` puts every original forward back, so a
model trained fast runs anywhere without opadvisor. The recognised modules and the rules each fix
answers are listed in `opadvisor/libraries.py` (the same table `opadvisor suggest` reads):

- BERT-family self-attention (transformers' BertSelfAttention and the classes that are BERT's, class for
  class: RoBERTa, XLM-R, ELECTRA, ...), when the model runs the eager attention: one
  `F.scaled_dot_product_attention`;
- BERT-family output blocks (BertSelfOutput / BertOutput): the dense bias, dropout and residual add as one
  `opadvisor.kernels.bias_dropout_add`, then `F.layer_norm`;
- GPT-2's attention (eager) as one `scaled_dot_product_attention`, GPT-2's MLP activation (the tanh GELU
  written op by op) as `F.gelu(x, approximate="tanh")`;
- `nn.TransformerEncoderLayer` in training (its slow path): each dropout + residual add as one
  `bias_dropout_add`; `nn.MultiheadAttention` called for weights it is not asked to give back
  (`need_weights=False`: unsafe, the weights become None);
- `nn.Linear` whose in/out features are not multiples of 8 (an LM head over a 30522- or 50257-word
  vocabulary): the GEMM on padded sizes (`opadvisor.kernels.padded_linear`), on CUDA;
- the LM heads' loss (BertForMaskedLM's masked-LM loss, GPT2LMHeadModel's ForCausalLMLoss): the model's
  forward runs as written with labels=None, then the loss it would have computed from those logits is
  `opadvisor.kernels.cross_entropy` over the 16-bit logits where they lie (no float32 copy of the
  [tokens, vocabulary] logits; -100 labels ignored, num_items_in_batch kept); with unsafe=True, in training
  with labels, BertForMaskedLM's decoder (product and bias) and its loss as one
  `opadvisor.kernels.linear_cross_entropy` (hf_mlm_linear_cross_entropy: logits None);
- the Llama family (Llama, Mistral, Qwen2/3 and the classes `opadvisor.libraries.llama_family_classes`
  lists): RMSNorm as `opadvisor.kernels.rms_norm` (one Triton kernel each way), the SwiGLU MLP's
  `act(gate(x)) * up(x)` as `opadvisor.kernels.silu_mul`, Llama's attention with its rotary embedding as
  `opadvisor.kernels.rotary_embedding` (the attention as transformers runs it), the causal-LM loss as GPT-2's
  above;
- GPT-2 and the Llama family with unsafe=True, in training with labels: the LM head and its loss as
  `opadvisor.kernels.linear_cross_entropy` (chunked over tokens: the logits are never whole, never float32; the
  output's logits are None);
- DeBERTa-v2/v3 (transformers' DebertaV2*): the disentangled self-attention's relative-position scores as
  one `opadvisor.kernels.disentangled_bias` and the attention as one `F.scaled_dot_product_attention` with
  them and the padding mask as its float mask (hf_deberta_attention); the encoder's relative positions built
  once per sequence length (hf_deberta_positions); the output blocks as BERT's; DebertaV2ForMaskedLM's loss
  as BertForMaskedLM's;
- asked for by name only (`rules=["compile_blocks"]`, never by `rules=None`: it costs compile time): the
  model's repeated library blocks (`opadvisor.libraries.repeated_blocks`: the outermost library class with
  two or more instances, such as BertLayer x12) each run one forward compiled by torch.compile, built on
  `opadvisor.kernels.compile_region` and shared by all instances of the class, so dynamo traces it once
  (not once per layer: its cache is keyed by the code, its guards by the module's state, not its identity)
  and inductor fuses the memory-bound ops between the matrix products. A compile that fails prints one line
  and every instance gets its original forward back; inside an outer torch.compile the original runs.
  Other patches are not installed inside a compiled block (reported as left): their first-call check
  cannot run under compile, and what they fuse by hand inductor fuses there with its neighbours.

How it stays honest:

- Per instance: `types.MethodType` on the module object; never a class, never a global. A teacher and a
  student in one process are patched (or not) each on its own.
- Exact undo: `unpatch` restores each instance's `forward` as it was (the class's, or what another tool
  such as `cuda_graphed` had put there) and drops opadvisor's attribute. Parameters and buffers are never
  touched: `state_dict` keys and values are identical before, during and after.
- Checked: the first call of each patched module (of each call path: training or evaluation, gradients on
  or off, which arguments are given) runs the original forward and the replacement on copies
  of its inputs with dropout off, and compares the outputs and, where the call computes gradients, the
  gradients (inputs and parameters);
  where they differ beyond the rounding of the dtype, that module keeps its original forward and a
  one-line warning says why. The check runs eagerly; under torch.compile or a CUDA-graph capture a
  module not yet checked runs its original forward (patch before compiling, and run one eager step).
- The source the replacements were written against is recognised, not assumed: a transformers class is
  patched only when its forward is, statement for statement, the one opadvisor's replacement reproduces
  (`_FINGERPRINTS`, read the same on every Python version); a release that changed it is reported by
  name, never patched blindly.
- Said out loud: `patch` prints what it patched and what it left, and why (`quiet=True` to silence it;
  `patch_report(model)` returns it). A model with nothing opadvisor knows gets that message, never a
  silent nothing.

    import opadvisor
    model = opadvisor.patch(model)                          # the safe replacements
    model = opadvisor.patch(model, rules=["sdpa_attention"])  # only what fixes these rules' findings
    opadvisor.unpatch(model)                                # the original model again

Where things are (a family of patches is a module; families import shared.py, arguments.py, fingerprint.py,
report.py (compile_blocks.py install.py too), never the engine; registry.py imports the families, engine.py
the registry):

    engine.py          patch / unpatch / patch_report: the walk over the model
    install.py         one instance installed, called (first-call check first) and restored
    check.py           the first-call check: outputs and gradients compared, the float32 judgement
    report.py          PatchReport and its text
    fingerprint.py     source_fingerprint and the fingerprints of the forwards the replacements reproduce
    shared.py          the per-instance record (_State), _Patcher, the checks' and families' common helpers
    arguments.py       a call's arguments by name, the KV cache
    registry.py        PATCHERS: every patcher, one line each
    bert.py, gpt2.py, torch_nn.py, lm_loss.py, llama.py, deberta.py, compile_blocks.py, hf_switch.py:
                       the families (hf_masks.py: the SDPA masks hf_switch.py registers)
"""

from .engine import patch, patch_report, unpatch
from .report import PatchReport

__all__ = ["PatchReport", "patch", "patch_report", "unpatch"]
