"""Verification: run the original and the rewritten script, compare losses and step times."""
