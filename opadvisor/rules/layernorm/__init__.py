"""The layernorm family: normalisations written by hand (mean, variance, square root as separate ops).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, its facts, `detect`) with its fix
beside it (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
