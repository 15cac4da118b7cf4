"""Kernels, one file each: Triton kernel + launcher + `*_ref` in plain PyTorch."""
