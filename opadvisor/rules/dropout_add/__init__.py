"""The dropout_add family: a bias add, dropout and residual add run as separate full-size passes (the
transformer block's "dropout + residual").

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, its facts, `detect`) with its fix
beside it (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). The dropout ops it shares with
attention are in `rules/_attention.py`. See docs/ADDING_A_RULE.md.
"""
