"""Fused kernels bundled with opadvisor, imported by rewritten scripts as ``opadvisor.kernels``."""
