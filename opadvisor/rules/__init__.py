"""Rules: one module per pattern, `detect(profile) -> list[Finding]`, grouped in family packages
(`opadvisor/rules/<family>/`, each rule with its fix beside it); see registry.py and docs/ADDING_A_RULE.md."""
