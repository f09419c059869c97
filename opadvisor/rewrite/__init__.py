"""Rewrites: one libcst codemod per fixable rule, and the engine that applies them safely."""
