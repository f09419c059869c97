"""Rewrites: the engine that applies the rules' fixes safely (each fix is a libcst codemod beside its rule in
the rule's family package, `opadvisor/rules/<family>/<rule>_fix.py`), their base class and shared helpers."""
