"""`_sparse_gemv_kernel` compiled for sm_90 without a GPU, as `_sparse_gemv_op` launches it: the
argument types and the specialisations the launcher gives (16-byte aligned pointers, whole-tile
sizes, rank 16). For tests that read the PTX (docs/kernels/sparse_gemv.md) and for
`benchmarks/kernels/gemv_registers.py` (registers and spills of the step's launches)."""

from __future__ import annotations

import torch

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_sparse_gemv(dtype: torch.dtype, consts: dict, num_warps: int = 1, maxnreg: int | None = None):
    """The compiled kernel (its .asm holds 'ptx' and 'cubin') for constexprs `consts` (every one of
    the kernel's); with consts['LORA'] the adapter's pointers and rank are specialised as well."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsedecode.kernels.sparse_gemv import _sparse_gemv_kernel as fn

    ty = TYPES[dtype]
    types = dict(X=ty, W=ty, Bias=ty, Y=ty, U=ty, Thr0="*fp32", Thr1="*fp32", Thr2="*fp32", Acc="*fp32",
                 Count="*i32", thr_f="fp32", Res=ty, SsOut="*fp32", SsIn="*fp32", eps="fp32",
                 At=ty, Bt=ty, lora_s="fp32", lora_s1="fp32", lora_s2="fp32")
    names = fn.arg_names
    sig = {n: types.get(n, "i32") for n in names}
    sig.update({n: "constexpr" for n in consts})
    # what the launcher specialises (torch's allocations are 16-byte aligned; 4096-row splits are whole tiles)
    aligned = [(names.index(n),) for n in ("X", "W", "Y", "Acc", "N", "stride_wk", "rows_per_split", "K")
               + (("At", "Bt", "rank", "a_stride") if consts.get("LORA") else ())]  # rank 16: specialised too
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                    attrs={a: [["tt.divisibility", 16]] for a in aligned})
    options = dict(num_warps=num_warps, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


__all__ = ["TYPES", "compile_sparse_gemv"]
