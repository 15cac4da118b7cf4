"""The whole one-token decode step on CPU as one C call (`cpu_step.c`; issue 46 item 2).

The C side runs every layer of a Llama-family decoder (RMSNorm, the q|k|v GEMV, q/k norms, RoPE,
the cache write, attention over the valid prefix or a selection's compact buffer, o, gate|up,
SwiGLU, down, residual adds), then the final norm and the LM head, with the projections through
`cpu_gemv.c`'s input-sparse GEMVs: one threshold per site read through a pointer, -inf for a dense
site. This module holds the C structures (`Layer`, `Model`) and the call; what fills them from a
model is `engine.cpu_step`. Built into the same library as the GEMVs (`cpu_gemv.cpu_kernel`).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import cpu_kernel

NSITES = 7  # q, k, v, o, gate, up, down: the order of each layer's thresholds and kept counts
_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class Layer(ctypes.Structure):
    """`sd_layer` of cpu_step.c: one decoder layer's weights, norms, thresholds and cache."""

    _fields_ = [("w_qkv", _P), ("w_o", _P), ("w_gu", _P), ("w_down", _P),
                ("ld_qkv", _L), ("ld_o", _L), ("ld_gu", _L), ("ld_down", _L),
                ("b_qkv", _P), ("b_o", _P), ("b_gu", _P), ("b_down", _P),
                ("norm_attn", _P), ("norm_mlp", _P), ("q_norm", _P), ("k_norm", _P),
                ("thr", _P * NSITES),
                ("k_cache", _P), ("v_cache", _P), ("t_cache", _L),
                ("k_comp", _P), ("v_comp", _P), ("t_comp", _L), ("comp_offset", _P)]


class Model(ctypes.Structure):
    """`sd_model` of cpu_step.c: dims, RoPE tables, embedding, final norm and LM head."""

    _fields_ = [("n_layers", _L), ("dim", _L), ("n_heads", _L), ("n_kv_heads", _L), ("head_dim", _L),
                ("d_ff", _L), ("vocab", _L), ("eps", _F), ("scale", _F),
                ("rope_cos", _P), ("rope_sin", _P), ("rope_len", _L),
                ("embed", _P), ("embed_row", _L), ("embed_col", _L),
                ("norm_final", _P), ("w_head", _P), ("ld_head", _L), ("b_head", _P)]


def step_entry(dtype: torch.dtype):
    """The C step for weights (and cache) of `dtype`, or None where the kernel was not built for it."""
    return cpu_kernel().entry("sd_step", dtype)


def run_step(fn, model: Model, layers, token: int, pos: int, out: Tensor, kept: Tensor | None) -> None:
    """One decode step: `token` at `pos` through the model the structures describe; `out` (float32,
    contiguous) receives the logits (or the normed final state without an LM head), `kept` (int64,
    NSITES per layer, or None) each site's kept input channels."""
    rc = fn(ctypes.byref(model), layers, int(token), int(pos), out.data_ptr(),
            None if kept is None else kept.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise InputError(f"position {pos} is outside the cache, the compact buffer or the RoPE tables")
    if rc != 0:
        raise MemoryError("the CPU decode step could not allocate its scratch")


__all__ = ["NSITES", "Layer", "Model", "run_step", "step_entry"]
