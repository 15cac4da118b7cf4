"""Kernels, one file each: Triton kernel + launcher + `*_ref` in plain PyTorch.

What they launch with is data, `kernels.options.KernelOptions`, owned by the engine and passed
down as arguments (never a module global set from outside); tuned tile configs are JSON per
device under `kernels/tuned/`; the choices that were measured and lost are in the decision logs
under docs/kernels/.
"""
