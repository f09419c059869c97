"""Rules: one module per pattern, `detect(profile) -> list[Finding]`; see registry.py."""
