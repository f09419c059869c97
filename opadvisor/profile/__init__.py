"""Profiling: run a training script under torch.profiler and turn what it recorded into a Profile."""
