"""The gemm family: matrix products that miss the tensor cores (float32 without TF32 or autocast, sizes
that are no multiple of 8).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
