"""The strategies a GPU target may list (backends/gpu/strategy.py says how they are applied):
one module each, a `strategy(...)` factory returning a Strategy with its matcher and emitter;
the kernel templates they splice in live in gac_torch/kernels/."""
