"""The regions family: hot chains of memory-bound kernels without a name (hand-written activations,
dropout written by hand, scale after a matmul), fixed with an exact equivalent or by fusing the region.

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). The region declarations are in
`rules/_regions.py`, kept there for the shared profile and source matchers (issue 32, item 2). See
docs/ADDING_A_RULE.md.
"""
