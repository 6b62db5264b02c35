"""GAC-Torch."""
