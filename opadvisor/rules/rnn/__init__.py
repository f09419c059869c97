"""The rnn family: rules about recurrent layers (a cell stepped in a Python loop, nn.LSTM / nn.GRU /
nn.RNN off cuDNN's fast path).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, its facts, `detect`) with its fix
beside it (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
