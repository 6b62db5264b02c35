"""Developer tools: the coverage table (`python -m gac_torch.tools.coverage`) and the per-op
OpInfo parity report (`python -m gac_torch.tools.opinfo`)."""
