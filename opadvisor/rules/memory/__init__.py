"""The memory family: steps whose peak memory limits the batch (activations kept for backward that could
be recomputed).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, its facts, `detect`) with its fix
beside it (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
