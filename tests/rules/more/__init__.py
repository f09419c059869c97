"""Tests of the rules host_sync, dataloader_stall, fp32_gemm, manual_layernorm and fused_optimizer."""
