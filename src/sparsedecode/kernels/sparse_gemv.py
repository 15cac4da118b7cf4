"""Input-sparse matrix-vector product for one decode token (ByteCross §3.2, §4.1, App. A).

TEAL-style projection sparsity keeps input channel i of a projection when
|x_i| > t and reads only the weights of kept channels: y = sum over kept i of
x_i * W[:, i] (+ bias). The paper runs it on all seven projections of every
layer through a Triton sparse GEMV, so a keep of 50% reads about half of the
projection bytes (§3.2, §4.1). That only holds when dropped weights never cross
the memory bus, which fixes the layout and the kernel:

- The weight is stored transposed, w_t (K, N) contiguous, so the N outputs of
  one input channel are one contiguous row. A program's load of a row segment
  is BLOCK_N elements (512 bytes in bf16/fp16), a whole number of 32-byte
  sectors and 128-byte lines: skipping a channel skips whole sectors.
- The threshold test is fused: each program loads its slice of x, forms the
  row mask |x| > t and issues the weight load with that mask. A masked-off
  lane issues no memory transaction, so a dropped row costs no DRAM bytes, and
  there is no separate mask, compaction or gather kernel.
- Batch-1 decode has too few output tiles to fill 132 SMs (4096 outputs are
  16 tiles of 256), so the grid is (N tiles, K splits), sized once from the
  SM count. A program is one warp over BLOCK_N = 512 bytes of columns; each lane
  holds all BLOCK_K rows of its 8 columns, so the fp32 sum over rows is in-thread
  and the registers go to loads in flight (the kernel is latency-bound at low
  keep unless many tiles are in flight per SM; see PROGRAMS_PER_SM).
- The K splits of a tile are reduced in the same kernel: each program adds its
  fp32 partial into a workspace with atomics (the workspace is N floats and
  stays in L2, so this adds no DRAM traffic), then bumps a per-tile arrival
  counter; the program that arrives last takes the sum with an atomic
  exchange (which leaves the workspace at zero), adds the bias, casts to the
  output dtype and resets the counter. One launch, a fixed grid, no host sync
  and a workspace that is all-zero again after every call: safe to capture in
  a CUDA graph and to replay any number of times.

`sparse_gemv_ref` is the same math as a masked PyTorch reference: it reads the
whole weight and zeroes the dropped channels, so it saves no bytes. It is the
CPU path of `SparseLinear` and the oracle of the tests; wherever it stands in
for the kernel it is labelled 'masked'.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from sparsedecode.errors import InputError

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_BYTES = 512  # bytes of one row segment per warp: 4 lines of 128 B, one 16-byte vector per lane
BLOCK_K = 16  # rows per loop iteration: 8 KB of weight per one-warp program at full keep
# Warps per program. A program of w warps is w one-warp column tiles of one split side by side
# (sm_90 layout: warps along the columns, each lane still summing its tile's rows in-thread), so
# the grid holds PROGRAMS_PER_SM / w programs per SM: the same warps, w times fewer CTAs to launch
# and w times fewer arrival counters. Measured on the H200 (`sparse_gemv_bench.py --configs`, records
# h200/sparse_gemv_20261201T0310Z_multiwarp): 2, 4 and 8 warps cut an empty launch of gate_up's grid
# from 2.06 us to 1.43, 1.10 and 1.01, and gate_up and down at keeps 0.5 and 0.3 were no faster
# (within -0.4 and +0.8 us of the default's 13-18 us): the launch is off the critical path. One warp.
# `sparse_gemv_bench.py --gemv-warps` and `proj_decode_h200.py --gemv-warps` set it.
NUM_WARPS = 1
# The loop variant ("stages"): 1 plain, 4 two tiles in flight, 8 a kept-row list. Stages 3 (each
# program first lists the kept rows of its split, ranks by a prefix sum stored in an L2 scratch,
# and loops over full tiles of them) did not beat the plain loop on gate_up or down at keeps 0.5
# and 0.3 (records h200/sparse_gemv_20261130T071253Z); stages 2 (the next x slice prefetched)
# gave way to stages 4. An earlier packed loop that ranked rows by a rank matrix ran 1.5-2x slower (records
# h200/sparse_gemv_20261129T203104Z). 4: two tiles' weight loads in flight (an
# iteration issues tile i + 1's loads before summing tile i), after Nsight Compute showed the
# plain loop's warps stalled on their loads with DRAM at 63% of peak at keep 0.5 (records
# h200/sparse_gemv_profile_20261130T0941Z). It is the default: at 16 programs per SM it beat or
# tied the plain loop at 24 on the decode step's four shapes (fused q|k|v, o, fused gate|up,
# down) at keeps 0.5 and 0.3, except gate|up at 0.3 (4% slower), and took the llama-3.1-8b
# decode step from 84.2% (records h200/sparse_gemv_20261130T095127Z, where every stages-4
# config failed to compile) to 85.9% of its byte bound (records h200/sparse_gemv_20261130T095622Z).
# Stages 5 (warps splitting a tile's rows), 6 (unrolled by two tiles) and 7 (a uniform branch
# around each dropped row's arithmetic, written after Nsight Compute found this loop
# instruction-bound at keep 0: records h200/sparse_gemv_20261130T1325Z_ncu_sass) did not beat it
# on the decode step's shapes at keeps 0.5 and 0.3 but on o (records
# h200/sparse_gemv_20261130T1305Z, h200/sparse_gemv_20261130T1333Z_stages67). Stages 8 (stages 3's
# kept-row list with two tiles in flight: instructions scale with the keep) wins on o only and is
# its built-in config (TUNED); on gate_up and down its 8-row tiles (16 spill) hold fewer rows in
# flight and the fullest split sets the time (records h200/sparse_gemv_20261130T1455Z_kept_row_list).
# Stages 9 (tensor cores, cp.async pipeline in shared memory) and 10 (9 over a kept-row list) lost
# at keeps 0.5 and 0.3 on every shape (records h200/sparse_gemv_20261130T1513Z_tensor_cores,
# h200/sparse_gemv_20261130T1519Z_tc_list), and so did 11 (a kept-row list gathered by cp.async
# into shared memory) and 12 (11 with the kept rows dealt out evenly over the splits) but for a
# tie on o (h200/sparse_gemv_20261130T1718Z_pipe_list). Stages 9 to 12 were removed after 58e3e09,
# stages 2, 3, 5, 6 and 7 after 512e6bb: run those commits to repeat their records.
NUM_STAGES = 4
# Programs per SM at the default split. A row skipped is a load not issued, so at keep 0.3 a
# program has only 0.3 x its tile in flight, and the SM must hold many tiles at once to cover
# the DRAM latency (Little's law: ~30 KB in flight per SM at 4.15 TB/s). In-flight bytes cost
# registers, so the accumulator is 1-D and one warp wide (each lane sums its 8 columns over
# the tile's rows in-thread). Measured on the H200 (`benchmarks/sparse_gemv_bench.py --sweep`,
# records in benchmarks/records/h200/sparse_gemv_20261129T194455Z): 16-row tiles in 24
# one-warp programs per SM beat every other of 19 configs on 5 of 6 projection shapes, and
# 32-row tiles in 12 per SM (the first guess) ran 1.3-2x slower; one-tile-per-program grids
# and 2-8 warps per program were slower too. With two tiles in flight per warp (stages 4) 16
# programs per SM beat 24 and 32 (records h200/sparse_gemv_20261130T095622Z).
PROGRAMS_PER_SM = 16
# Programmatic dependent launch (Hopper and later): each launch may start while the kernel before it
# drains, its programs waiting at the top (`gdc_wait`) until that kernel's writes are visible. On.
# Standalone, back to back, it took 0.6-0.7 us off a call (gate_up and down at keeps 0.5 and 0.3,
# `sparse_gemv_bench.py --pdl early`). In the llama-3.1-8b decode step at keep 0.5 it lost while the
# RMSNorms and residual adds ran in kernels of their own (3.312 ms against 3.247, records
# h200/sparse_gemv_20261130T1305Z); with them inside the GEMVs (sparse_linear.FUSE_NORMS) three of a
# layer's four sparse launches follow another sparse launch, and the step read 93.4% and 93.5% of its
# byte bound against 91.0% and 91.1% without it, and 92.4% against 90.1% in an earlier run (records
# h200/sparse_gemv_20261201T0625Z_pdl, h200/sparse_gemv_20261201T0620Z_step_calls). The split-K
# attention launched so too (`decode_attention.PDL`) made that step slower. Only CUDA launches use it.
PDL = True
# With PDL, let the next kernel launch at the start (else as each program exits). In the step the exit
# trigger read 90.6% of the bound, as without PDL, against 93.4% (records h200/sparse_gemv_20261201T0650Z_pdl_trigger).
PDL_TRIGGER = True
# True: weight loads carry the evict-first cache hint (each weight byte is read once per step, so
# the hint keeps x, the workspace and the next kernel's data in L2; TEAL's kernel uses such
# hints). Off until measured: `sparse_gemv_bench.py --evict-first`.
WEIGHTS_EVICT_FIRST = False
# True: stages 4, 8, 11 and 12 read bf16 weights as int32 pairs and widen them with integer ops
# (`_sum_tile`), about one instruction per element fewer than Triton's bf16 conversion (the sm_90
# stages 4 loop 13% shorter). On the H200 it took gate_up, down, gate|up and q|k|v at keep 0.3
# from 15.0, 14.8, 25.8 and 9.1 us to 14.0, 13.7, 23.9 and 8.8 (keep 0.5: 0.0-0.6 us less), and
# the llama-3.1-8b step at keep 0.5 from 84.0% to 85.0% of its byte bound in the same session
# (records h200/sparse_gemv_20261130T1513Z_tensor_cores).
BF16_PAIRS = True
# True: stages 4 compiles the weight's row stride in as a constant (one kernel per stride), so the
# 16 rows of a tile load from one address plus immediate offsets, where a row's 64-bit address
# formed at run time costs two instructions (sm_90 loop of a gate_up tile: 449 instructions
# against 501; 460 against 525 with the fused norm). On the H200 gate_up and down at keep 0.3
# took 0.5-0.7 us less and at keeps 0.5 and 1 up to 0.3 us less, and the llama-3.1-8b step at
# keep 0.5 was unchanged, at 90.0-90.2% of its byte bound (records
# h200/sparse_gemv_20261130T2307Z_stride_offsets). The stride operand alone (rows still addressed
# one by one) read 91.6% and 92.0% against 90.7% and 90.5% on another machine (records
# h200/sparse_gemv_20261130T2257Z_stride_const). An earlier variant that also formed each row's
# input once per split, in an L2 scratch, lost: its prologue puts a round trip to L2 before the
# first weight load (records h200/sparse_gemv_20261130T2252Z_x_once; run 4430254 to repeat it).
ROW_STRIDE_CONST = True
# Timing ablations of stages 4, to find where a call's fixed cost goes (never for results: an ablated
# call computes something else). A bitmask: 1, no split-K finish: each program stores its partial
# straight to the output (the programs of a tile overwrite each other; no atomic adds, arrival count
# or exchange); 2, no x: rows kept by parity (every even row, with x = 1) and no threshold load, so a
# program's first weight loads wait on nothing; 4, the finish's atomic adds only (no arrival count,
# exchange or output: the sum stays in the workspace, which is then not zero again). Calls with up,
# residual, norm or segments take them only with bit 2, so that no kept row follows an ablated input
# (`proj_decode_h200.py --ablate` runs the decode step so). `sparse_gemv_bench.py --ablate` times them. On the
# H200 the finish was 1.1-1.8 us of a call and the x chain 0.2-0.8 us; with both gone gate_up at
# keep 0.5 ran 1.13-1.14x its byte time (records h200/sparse_gemv_20261201T0400Z_ablate_twice). In the
# decode step that did not come off: gate|up without its arrival count and exchange (atomic adds kept,
# SwiGLU formed from the sums by a kernel of its own) ran no faster, and with each split's partial
# stored plainly in a row of its own it ran slower (records h200/sparse_gemv_20261201T0455Z_defer_finish,
# h200/sparse_gemv_20261201T0500Z_defer_rows; the code, DEFER_GATE_UP_FINISH, is at 7a26b6d). With x
# ablated in every call of the step, the arrival count, exchange and output cost 1.0-2.0 us a call and
# the atomic adds 0.4-0.6 (records h200/sparse_gemv_20261201T0613Z_step_ablate, ..._0620Z_step_calls):
# parity rows give every split the same work, so a tile's programs reach the finish together.
ABLATE = 0
# True: the last program of a tile to arrive reads the tile's sum from the workspace with vector
# loads that bypass L1 and writes the zeros back with vector stores, where False takes the sum and
# leaves the zeros with one atomic exchange per column (scalar b32 atomics in the sm_90 PTX, 8 a
# lane). Both follow the acquire of the arrival count. One-warp programs only (`finish_mode`; every
# default config is one warp). On: on the H200 it took 0.0-0.4 us off a
# call on the step's shapes (gate_up, down, q_o, qkv, gate_up2) at keeps 0.5 and 0.3 in one process,
# and the llama-3.1-8b step at keep 0.5 (2K, prefilled cache) from 2.952 ms to 2.918 and 2.919 in
# alternating processes: 95.9% of its byte bound twice against 94.7% and 94.9% (records
# h200/sparse_gemv_20261201T1042Z_finish_load). `--no-finish-load` on both benchmarks times the exchange.
FINISH_LOAD = True
# True: that last program puts the tile's arrival count back at zero with a plain store, where False
# uses an atomic exchange whose return the program waits for before it exits (no program of this
# launch reads the count after the last arrival; the next launch reads it after this one completes).
# One-warp programs only, as FINISH_LOAD. On: on the H200 it took 0.0-0.3 us off a call on the step's five shapes at keeps 0.5 and 0.3 in one
# process, and the llama-3.1-8b step at keep 0.5 (2K, prefilled cache) from 2.917 and 2.920 ms to
# 2.892 twice in alternating processes: 97.1% and 96.7% of its byte bound against 96.0% twice (records
# h200/sparse_gemv_20261201T1049Z_reset_store). `--no-reset-store` on both benchmarks times the exchange.
RESET_STORE = True


def finish_mode(num_warps: int) -> int:
    """The kernel's FIN bits for programs of `num_warps` warps: 1 FINISH_LOAD, 2 RESET_STORE.

    One-warp programs only (the defaults, where both were measured and tested). On the H200 a
    two-warp config (down, BLOCK_N 512, SwiGLU input and residual, keep 0.5) returned 60 of 4096
    outputs near the residual alone with both on (`sparse_gemv_bench.py` check, records
    h200/sparse_gemv_20261201T1133Z_fused_resweep/down.log), where the same config had passed with
    the atomic exchanges (h200/sparse_gemv_20261130T1950Z_fused_sweep). Until that is understood,
    programs of several warps keep the exchanges."""
    if num_warps != 1:
        return 0
    return int(FINISH_LOAD) | 2 * int(RESET_STORE)


# A lower register cap than the one-wave budget of `max_registers` (None: that budget), for timing.
REGISTER_CAP: int | None = None
CPU_SPLITS = 3  # under the interpreter: several splits, so the atomic reduction is exercised
MIN_BLOCK = 16  # smallest BLOCK_N (and default BLOCK_K); workspace() sizes its counters for it
MIN_BLOCK_K = 4  # smallest BLOCK_K a config may ask for (fewer rows, more programs in flight)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_inputs(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None) -> tuple[int, int]:
    """Validate sparse-GEMV operands; returns (K, N)."""
    if w_t.dim() != 2:
        raise InputError(f"sparse_gemv wants w_t (K, N), the weight transposed; got {tuple(w_t.shape)}")
    K, N = w_t.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise InputError(f"x {tuple(x.shape)} does not end in K={K}, the rows of w_t {tuple(w_t.shape)}")
    if x.numel() != K:
        raise InputError(
            f"sparse_gemv multiplies one token: x {tuple(x.shape)} holds {x.numel() // max(K, 1)} rows; "
            "run several tokens (prefill) densely"
        )
    if x.dtype != w_t.dtype or x.dtype not in DTYPES:
        raise InputError(
            f"sparse_gemv runs in float16, bfloat16 or float32 with one dtype for x and w_t; "
            f"got {x.dtype} and {w_t.dtype}"
        )
    if x.device != w_t.device:
        raise InputError(f"x lives on {x.device} and w_t on {w_t.device}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise InputError(f"bias must be ({N},) on {x.device}; got {tuple(bias.shape)} on {bias.device}")
    check_threshold(threshold, x.device)
    return K, N


def check_threshold(threshold, device) -> None:
    """A threshold is a float or a 1-element float tensor on the operands' device."""
    if isinstance(threshold, Tensor):
        if threshold.numel() != 1 or not threshold.dtype.is_floating_point:
            raise InputError(
                f"threshold must be a float or a 1-element float tensor; got {threshold.dtype} "
                f"{tuple(threshold.shape)}"
            )
        if threshold.device != device:
            raise InputError(f"threshold lives on {threshold.device}, x on {device}")
    elif not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a float or a 1-element tensor; got {type(threshold).__name__}")


def keep_mask(x: Tensor, threshold) -> Tensor:
    """Kept channels |x| > t, compared in float32 as the kernel does; bool, x's shape."""
    t = threshold.float() if isinstance(threshold, Tensor) else torch.tensor(float(threshold))
    return x.float().abs() > t.to(x.device).reshape(())


def sparse_gemv_ref(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None) -> Tensor:
    """Masked reference of `sparse_gemv`: dropped channels are zeroed, every weight is read.

    x (..., K) holding one token; w_t (K, N); threshold a float or 1-element float
    tensor; channel i is kept iff |x_i| > threshold (in float32). Returns (..., N) in
    x's dtype, sum over kept i of x_i * w_t[i, :] (+ bias) accumulated in float32.
    This is the CPU path ('masked': it saves no bytes) and the tests' oracle (§3.2).
    """
    K, N = check_inputs(x, w_t, threshold, bias)
    xm = torch.where(keep_mask(x, threshold), x.float(), 0.0)  # (..., K) float32
    y = xm @ w_t.float()  # (..., N) float32; no copy when w_t is float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# Measured tile configs, (K, N, dtype name, SM count) -> (BLOCK_N, BLOCK_K, splits, num_warps,
# num_stages); consulted before the rule of `default_config`. `load_tuned` adds the winners of
# `benchmarks/sparse_gemv_bench.py --sweep --choose FILE`. Built in, on a 132-SM GPU, the H200
# sweep's picks at keeps 0.5 and 0.3 after the split-K finish got cheaper (FINISH_LOAD, RESET_STORE):
# the o projection (4096 x 4096) and the fused q|k|v (4096 x 6144) of Llama-3-8B shapes run stages 4
# at 64 splits (about 8 and 12 programs an SM), o in 7.6 and 6.0 us against 9.0 and 6.4 for its
# former stages-8 entry (256, 8, 86, 1, 8), q|k|v in 9.4 and 7.5 against 9.6 and 7.6; fused gate|up
# and down kept the rule's. The llama-3.1-8b step at keep 0.5 with them read 98.2% and 98.1% of its
# byte bound against 97.0% and 96.7% in alternating processes (records
# h200/sparse_gemv_20261201T1054Z_finish_sweep). Stages 8 for o had won under the exchange finish
# (records h200/sparse_gemv_20261130T1519Z_tc_list, h200/sparse_gemv_20261130T1525Z_attn_splits).
TUNED: dict[tuple[int, int, str, int], tuple[int, int, int, int, int]] = {
    (4096, 4096, "bfloat16", 132): (256, 16, 64, 1, 4),
    (4096, 6144, "bfloat16", 132): (256, 16, 64, 1, 4),
}


def load_tuned(path) -> int:
    """Add the tile configs of a `--choose` file to TUNED; returns how many were read."""
    import json

    rows = json.loads(open(path).read())
    for row in rows:
        TUNED[(row["K"], row["N"], row["dtype"], row["sm_count"])] = tuple(row["config"])
    return len(rows)


def default_config(K: int, N: int, dtype: torch.dtype, device: torch.device,
                   programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages) for a (K, N) weight: static per shape
    and device.

    A measured config from TUNED when there is one; otherwise BLOCK_N spans ROW_BYTES of a
    row per warp (fewer for narrow N) and the K splits bring the grid to about
    `programs_per_sm` warps per SM (programs of NUM_WARPS warps), each split a whole number
    of BLOCK_K rows.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tuned = TUNED.get((K, N, str(dtype).removeprefix("torch."), _sm_count(index)))
        if tuned is not None:
            return tuned
    elem = torch.empty((), dtype=dtype).element_size()
    block_n = max(MIN_BLOCK, min(ROW_BYTES * NUM_WARPS // elem, _pow2(N)))
    block_k = max(MIN_BLOCK, min(BLOCK_K, _pow2(K)))
    n_tiles = -(-N // block_n)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        want = max(1, round(programs_per_sm * _sm_count(index) / (n_tiles * NUM_WARPS)))
    else:
        want = CPU_SPLITS
    return block_n, block_k, _splits(K, block_k, want), NUM_WARPS, NUM_STAGES


def max_registers(programs: int, num_warps: int, device) -> int:
    """Registers per thread that let every program of the grid be resident at once.

    The grid is sized for one wave (PROGRAMS_PER_SM), and ptxas's register count is not
    stable under small changes of the kernel source: the same PTX but for the order of a
    few instructions took 96 registers at b836621 and 151 after the SwiGLU change, so 13
    rather than 16 programs fit an SM, the grid ran in 1.2 waves and every call took 4 µs
    longer on the H200 (records h200/sparse_gemv_20261130T1303*). Capping registers at the
    one-wave budget (multiples of 8, at most 255) keeps the grid in one wave.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_sm = -(-programs // _sm_count(index))  # programs each SM must hold
    regs = 65536 // (per_sm * 32 * num_warps) // 8 * 8
    if REGISTER_CAP is not None:
        regs = min(regs, REGISTER_CAP)
    return max(32, min(255, regs))


def _rows_per_split(K: int, block_k: int, splits: int) -> int:
    per = -(-K // splits)  # ceil(K / splits)
    return -(-per // block_k) * block_k  # rounded up to whole BLOCK_K tiles


def _splits(K: int, block_k: int, want: int) -> int:
    """The split count actually used for `want`: every split gets >= 1 row."""
    want = max(1, min(want, -(-K // block_k)))
    return -(-K // _rows_per_split(K, block_k, want))


def workspace(N: int, device, block_n: int = MIN_BLOCK) -> tuple[Tensor, Tensor]:
    """Zeroed (fp32 partial sums (N,), int32 arrival counters (tiles,)) for N outputs.

    The kernel leaves both at zero again, so one workspace serves any number of calls
    in sequence (and in a CUDA graph); sized for the smallest BLOCK_N, it fits any config.
    """
    return (torch.zeros(N, device=device, dtype=torch.float32),
            torch.zeros(-(-N // block_n), device=device, dtype=torch.int32))


if triton is not None:

    @triton.jit
    def _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, n0, THR_T: tl.constexpr, NSEG: tl.constexpr):
        """The threshold of the column tile starting at n0: one scalar, or the one of the
        segment [0, b1), [b1, b2), [b2, N) it lies in (segment bounds on the tile grid)."""
        if THR_T:
            t = tl.load(Thr0).to(tl.float32)
        else:
            t = thr_f
        if NSEG > 1:
            t1 = tl.load(Thr1).to(tl.float32)
            t2 = t1
            if NSEG > 2:
                t2 = tl.load(Thr2).to(tl.float32)
            t = tl.where(n0 < b1, t, tl.where(n0 < b2, t1, t2))
        return t

    @triton.jit
    def _finish_splits(Acc, Count, Bias, Y, acc, offs_n, mask_n, tile, num_splits, HAS_BIAS: tl.constexpr,
                       Res, SsOut, RESID: tl.constexpr, FIN: tl.constexpr):
        """Add this split's fp32 partial of a column tile; the last split to arrive writes
        the sum (+ bias) to Y and leaves the workspace and the tile's counter at zero.

        With RESID, Y is the residual stream after the projection: the sum rounded to Y's
        dtype, plus the residual at Res, rounded again (as eager `x + proj(h)` rounds), and
        the tile's sum of squares of those rounded values goes to SsOut[tile], so the next
        RMSNorm needs no reduction kernel (`sparse_gemv(norm=...)` reads the partials)."""
        tl.atomic_add(Acc + offs_n, acc, mask=mask_n, sem="relaxed")
        # All lanes' partial adds precede the release of the arrival count (bar.sync, then a
        # release atomic, which is cumulative); the last arrival acquires it and so sees them.
        tl.debug_barrier()
        arrived = tl.atomic_add(Count + tile, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            if RESID:  # issued before the exchange, so the two trips to L2 overlap
                res = tl.load(Res + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if FIN & 1:  # FINISH_LOAD: the sum from L2 (ordered after the acquire), then the workspace back at zero
                total = tl.load(Acc + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                tl.store(Acc + offs_n, tl.zeros_like(total), mask=mask_n)
            else:  # the sum, and the workspace back at zero, in one atomic (on the float's bits)
                acc_bits = Acc.to(tl.pointer_type(tl.int32)) + offs_n
                total = tl.atomic_xchg(acc_bits, tl.zeros_like(offs_n), mask=mask_n,
                                       sem="relaxed").to(tl.float32, bitcast=True)
            if HAS_BIAS:
                total += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if RESID:
                total = total.to(Y.dtype.element_ty).to(tl.float32) + res
                sq = total.to(Y.dtype.element_ty).to(tl.float32)
                tl.store(SsOut + tile, tl.sum(tl.where(mask_n, sq * sq, 0.0), axis=0))
            tl.store(Y + offs_n, total.to(Y.dtype.element_ty), mask=mask_n)
            if FIN & 2:  # RESET_STORE
                tl.store(Count + tile, 0)
            else:
                tl.atomic_xchg(Count + tile, 0, sem="relaxed")

    @triton.jit
    def _load_x(Xp, Up, mask, GLU: tl.constexpr, r, NORM: tl.constexpr):
        """The input at pointers Xp in float32; with GLU, silu(x) * u with u at Up (SwiGLU's
        down input), each product rounded to x's dtype as eager PyTorch rounds silu(gate) and
        then * up; with NORM, RMSNorm's output w * (x * r) with its weight w at Up and r the
        reciprocal root mean square (`_norm_scale`), x * r rounded to x's dtype before the
        weight and the product rounded again, as `models.decoder.RMSNorm` rounds. Callers form
        the pointers as scalar base + offsets (64-bit adds, not a multiply-add per element: on
        Triton 3.6 that form took 21 fewer registers and ran slower)."""
        x = tl.load(Xp, mask=mask, other=0.0)
        if GLU:
            g = x.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(Xp.dtype.element_ty).to(tl.float32)
            u = tl.load(Up, mask=mask, other=0.0).to(tl.float32)
            x = (s * u).to(Xp.dtype.element_ty)
        if NORM:
            x = _norm_x(x, tl.load(Up, mask=mask, other=0.0), r)
        return x.to(tl.float32)

    @triton.jit
    def _x_slice(Xp, Up, offs, mask, GLU: tl.constexpr, r, NORM: tl.constexpr, ABLATE: tl.constexpr):
        """`_load_x` of rows offs, or with the x ablation (ABLATE & 2) 1.0 on even rows and 0.0 on
        odd ones, loading nothing."""
        if ABLATE & 2:
            return tl.where(mask & (offs % 2 == 0), 1.0, 0.0)
        else:
            return _load_x(Xp, Up, mask, GLU, r, NORM)

    @triton.jit
    def _norm_x(x, w, r):
        """RMSNorm's output of loaded x and weight w, given r (`_load_x` with NORM), in x's dtype."""
        h = (x.to(tl.float32) * r).to(x.dtype).to(tl.float32)
        return (w.to(tl.float32) * h).to(x.dtype)

    @triton.jit
    def _norm_scale(SsIn, n_ss, K, eps, NORM: tl.constexpr, SS_BLOCK: tl.constexpr):
        """RMSNorm's 1 / sqrt(mean(x^2) + eps) from the n_ss partial sums of squares the
        producing projection left (`_finish_splits` with RESID); 1.0 without NORM."""
        if NORM:
            offs = tl.arange(0, SS_BLOCK)
            ss = tl.sum(tl.load(SsIn + offs, mask=offs < n_ss, other=0.0), axis=0)
            return tl.math.rsqrt(ss * (1.0 / K) + eps)  # as torch.rsqrt, on the critical path of every program
        else:
            return 1.0

    @triton.jit
    def _load_tile(W, k0, ar, in_k, x, t, offs_n, mask_n, stride, EVEN_N: tl.constexpr, EVICT: tl.constexpr,
                   STRIDE: tl.constexpr):
        """The (BLOCK_K, BLOCK_N) weight tile of rows k0 + ar whose |x| > t (and in range): masked
        rows issue no load. EVICT: the loads' cache eviction policy ('' or 'evict_first'). With
        STRIDE (the row stride a constant) the tile's pointers are one scalar address plus 64-bit
        offsets that fold to constants, so each row's load takes an immediate offset (sm_90 SASS)
        instead of an address formed per row."""
        keep = (tl.abs(x) > t) & in_k
        if STRIDE:
            ptr = (W + k0 * stride) + (ar[:, None].to(tl.int64) * stride + offs_n[None, :].to(tl.int64))
        else:
            ptr = W + (k0 + ar)[:, None] * stride + offs_n[None, :]
        if EVEN_N:
            w = tl.load(ptr, mask=keep[:, None], other=0.0, eviction_policy=EVICT)
        else:
            w = tl.load(ptr, mask=keep[:, None] & mask_n[None, :], other=0.0, eviction_policy=EVICT)
        return w

    @triton.jit
    def _list_kept_rows(X, U, Scratch, k_lo, k_hi, t, pid_n, pid_k, RPS: tl.constexpr, GLU: tl.constexpr,
                        r_norm, NORM: tl.constexpr):
        """(list base, kept count) of rows [k_lo, k_hi) with |x| > t: their ranks by a prefix sum,
        each row index stored at its rank in the program's own scratch (2 * RPS int32, in L2) and
        its x (float32 bits) at RPS + rank. Written before it returns, so no zeroing is needed."""
        offs_r = k_lo + tl.arange(0, RPS)  # (RPS,)
        in_r = offs_r < k_hi
        xr = _load_x(X + offs_r, U + offs_r, in_r, GLU, r_norm, NORM)
        kept = (tl.abs(xr) > t) & in_r
        rank = tl.cumsum(kept.to(tl.int32), axis=0) - 1
        n_kept = tl.sum(kept.to(tl.int32), axis=0)
        base = Scratch + (pid_k * tl.num_programs(0) + pid_n) * (2 * RPS)
        # rows are scaled by the row stride where they are read, where the launcher's
        # divisibility hint on the stride keeps the weight loads vectors
        tl.store(base + rank, offs_r, mask=kept)
        tl.store(base + RPS + rank, xr.to(tl.int32, bitcast=True), mask=kept)
        tl.debug_barrier()  # the list is written before any thread reads it
        return base, n_kept

    @triton.jit
    def _load_view(W, offs_n, mask_n, stride_wk, stride_w32, pid_n, N, BITS: tl.constexpr, COLS: tl.constexpr,
                   STRIDE: tl.constexpr = 0):
        """(pointer, column offsets, column mask, row stride) the weight loads use: W's columns,
        or with BITS its bf16 columns as COLS int32 pairs (N and the row stride even). STRIDE > 0
        is the row stride in elements as a constant, so a tile's rows are one address plus
        immediate offsets rather than an address computed per row."""
        if BITS:
            offs = pid_n * COLS + tl.arange(0, COLS)
            return W.to(tl.pointer_type(tl.int32)), offs, offs < N // 2, STRIDE // 2 if STRIDE else stride_w32
        else:
            return W, offs_n, mask_n, STRIDE if STRIDE else stride_wk

    @triton.jit
    def _columns(acc, acc_hi, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """The tile's BLOCK_N column sums in order: with BITS, the even and odd columns interleaved."""
        if BITS:
            return tl.reshape(tl.join(acc, acc_hi), [BLOCK_N])
        else:
            return acc

    @triton.jit
    def _sum_tile(acc, acc_hi, w, x, BITS: tl.constexpr):
        """acc (+ acc_hi) plus the tile's sum over rows of x * w in float32. With BITS, w is bf16
        weights read as int32 pairs (column 2j in the low half of word j): a bf16 is the top half
        of its float32, so the low column is the word shifted left by 16 and the high one the
        word with its low half cleared, one integer instruction per element where the bf16
        conversion took about two (a byte permute to extract, then the shift; sm_90 SASS).
        acc holds the even columns and acc_hi the odd ones."""
        if BITS:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
            return acc + tl.sum(lo * x[:, None], axis=0), acc_hi + tl.sum(hi * x[:, None], axis=0)
        else:
            return acc + tl.sum(w.to(tl.float32) * x[:, None], axis=0), acc_hi

    @triton.jit
    def _sparse_gemv_kernel(
        X, W, Bias, Thr0, Thr1, Thr2, Y, Acc, Count, thr_f, K, N, stride_wk, b1, b2,
        rows_per_split, num_splits,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, THR_T: tl.constexpr, NSEG: tl.constexpr,
        SEG_ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
        Scratch, COMPACT: tl.constexpr, RPS: tl.constexpr, DBUF: tl.constexpr,
        U, GLU: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr,
        PDL_TRIGGER: tl.constexpr, stride_w32, BITS: tl.constexpr, COLS: tl.constexpr,
        Res, SsOut, SsIn, n_ss, eps, RESID: tl.constexpr, NORM: tl.constexpr, SS_BLOCK: tl.constexpr,
        STRIDE: tl.constexpr, ABLATE: tl.constexpr, FIN: tl.constexpr,
    ):
        if PDL:  # launched as a programmatic dependent: every memory access waits for the
            # previous kernel; the launch and this prologue overlap its tail
            tl.extra.cuda.gdc_wait()
            if PDL_TRIGGER:  # let the next kernel launch now rather than as programs exit
                tl.extra.cuda.gdc_launch_dependents()
        # Program (n tile, k split); programs with adjacent n tiles of one split run side by
        # side, so together they stream whole kept rows of w_t.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        mask_n = offs_n < N
        # With NORM, x is the residual stream and the input is its RMSNorm, formed in each x load
        # (stages 4 computes r after its first x loads are issued, and this one is dead code)
        r_norm = _norm_scale(SsIn, n_ss, K, eps, NORM, SS_BLOCK)
        # Thresholds: one scalar, or one per column segment [0, b1), [b1, b2), [b2, N) of a
        # concatenated weight (q|k|v or gate|up, each site with its own threshold): per
        # program when the bounds are whole tiles, else per column.
        if NSEG > 1 and not SEG_ALIGNED:
            t_col = _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, offs_n, THR_T, NSEG)  # (BLOCK_N,)
        elif ABLATE & 2:  # rows kept by parity: x is 0 or 1
            t0 = 0.5
        else:
            t0 = _tile_threshold(Thr0, Thr1, Thr2, thr_f, b1, b2, pid_n * BLOCK_N, THR_T, NSEG)
        k_lo = pid_k * rows_per_split
        k_hi = tl.minimum(k_lo + rows_per_split, K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if COMPACT and DBUF and not (NSEG > 1 and not SEG_ALIGNED):
            # Stages 8: a kept-row list (removed stages 3's) with the two-tiles-in-flight loop of stages 4.
            # Stages 4 converts and multiplies every row of its split, kept or not (a dropped row
            # is a predicated-off load of zeros), and Nsight Compute found it bound by issue at
            # low keep; here the loop runs over kept rows only, so its instructions scale with
            # the keep as its bytes do, and each tile is full of kept rows.
            base, n_kept = _list_kept_rows(X, U, Scratch, k_lo, k_hi, t0, pid_n, pid_k, RPS, GLU, r_norm, NORM)
            Wl, offs_l, mask_l, stride_l = _load_view(W, offs_n, mask_n, stride_wk, stride_w32, pid_n, N,
                                                      BITS, COLS)
            acc_l = tl.zeros([COLS], dtype=tl.float32)
            acc_h = tl.zeros([COLS], dtype=tl.float32)
            ar = tl.arange(0, BLOCK_K)
            in_c = ar < n_kept
            off_c = tl.load(base + ar, mask=in_c, other=0)
            x_c = tl.load(base + RPS + ar, mask=in_c, other=0).to(tl.float32, bitcast=True)
            w_c = tl.load(Wl + off_c[:, None] * stride_l + offs_l[None, :],
                          mask=in_c[:, None] if EVEN_N else in_c[:, None] & mask_l[None, :], other=0.0,
                          eviction_policy=EVICT)
            in_n = BLOCK_K + ar < n_kept
            off_n = tl.load(base + BLOCK_K + ar, mask=in_n, other=0)
            x_n = tl.load(base + RPS + BLOCK_K + ar, mask=in_n, other=0).to(tl.float32, bitcast=True)
            for j0 in range(BLOCK_K, n_kept + BLOCK_K, BLOCK_K):  # j0: the tile loaded now
                in_j = j0 + ar < n_kept
                w_n = tl.load(Wl + off_n[:, None] * stride_l + offs_l[None, :],
                              mask=in_j[:, None] if EVEN_N else in_j[:, None] & mask_l[None, :], other=0.0,
                              eviction_policy=EVICT)
                in_nn = j0 + BLOCK_K + ar < n_kept
                off_nn = tl.load(base + j0 + BLOCK_K + ar, mask=in_nn, other=0)
                x_nn = tl.load(base + RPS + j0 + BLOCK_K + ar, mask=in_nn, other=0).to(tl.float32, bitcast=True)
                acc_l, acc_h = _sum_tile(acc_l, acc_h, w_c, x_c, BITS)  # tile j0 - BLOCK_K
                x_c, w_c, off_n, x_n = x_n, w_n, off_nn, x_nn
            acc_l, acc_h = _sum_tile(acc_l, acc_h, w_c, x_c, BITS)  # the last tile (all zeros if empty)
            _finish_splits(Acc, Count, Bias, Y, _columns(acc_l, acc_h, BITS, BLOCK_N), offs_n, mask_n, pid_n,
                           num_splits, HAS_BIAS, Res, SsOut, RESID, FIN)
            return
        if DBUF and not (NSEG > 1 and not SEG_ALIGNED):
            # Two tiles in flight: an iteration issues the weight loads of tile i + 1 (its x
            # slice loaded an iteration earlier, so the loads wait on nothing) and the x slice
            # of tile i + 2, and only then sums tile i. The plain loop leaves a warp with
            # nothing in flight while its x slice comes from L2 and while it sums.
            Wl, offs_l, mask_l, stride_l = _load_view(W, offs_n, mask_n, stride_wk, stride_w32, pid_n, N, BITS, COLS,
                                                      STRIDE)
            acc_l = tl.zeros([COLS], dtype=tl.float32)
            acc_h = tl.zeros([COLS], dtype=tl.float32)
            ar = tl.arange(0, BLOCK_K)
            if NORM and not ABLATE & 2:  # the first two x slices and the norm's partials in flight, then r
                p_c, p_n = k_lo + ar, k_lo + BLOCK_K + ar
                xr_c, wr_c = tl.load(X + p_c, mask=p_c < k_hi, other=0.0), tl.load(U + p_c, mask=p_c < k_hi, other=0.0)
                xr_n, wr_n = tl.load(X + p_n, mask=p_n < k_hi, other=0.0), tl.load(U + p_n, mask=p_n < k_hi, other=0.0)
                r_norm = _norm_scale(SsIn, n_ss, K, eps, NORM, SS_BLOCK)
                x_c = _norm_x(xr_c, wr_c, r_norm).to(tl.float32)
                w_c = _load_tile(Wl, k_lo, ar, p_c < k_hi, x_c, t0, offs_l, mask_l, stride_l, EVEN_N, EVICT, STRIDE)
                x_n = _norm_x(xr_n, wr_n, r_norm).to(tl.float32)
            else:
                x_c = _x_slice(X + k_lo + ar, U + k_lo + ar, k_lo + ar, k_lo + ar < k_hi, GLU, r_norm, NORM, ABLATE)
                w_c = _load_tile(Wl, k_lo, ar, k_lo + ar < k_hi, x_c, t0, offs_l, mask_l, stride_l, EVEN_N, EVICT,
                                 STRIDE)
                x_n = _x_slice(X + k_lo + BLOCK_K + ar, U + k_lo + BLOCK_K + ar, k_lo + BLOCK_K + ar,
                               k_lo + BLOCK_K + ar < k_hi, GLU, r_norm, NORM, ABLATE)
            for k0 in range(k_lo + BLOCK_K, k_hi + BLOCK_K, BLOCK_K):  # k0: the tile loaded now
                offs_k = k0 + ar
                w_n = _load_tile(Wl, k0, ar, offs_k < k_hi, x_n, t0, offs_l, mask_l, stride_l, EVEN_N, EVICT, STRIDE)
                x_nn = _x_slice(X + offs_k + BLOCK_K, U + offs_k + BLOCK_K, offs_k + BLOCK_K, offs_k + BLOCK_K < k_hi,
                                GLU, r_norm, NORM, ABLATE)
                acc_l, acc_h = _sum_tile(acc_l, acc_h, w_c, x_c, BITS)  # tile k0 - BLOCK_K
                x_c, w_c, x_n = x_n, w_n, x_nn
            if ABLATE & 1:  # no split-K finish: this split's partial, stored over the others'
                tl.store(Y + offs_n, _columns(acc_l, acc_h, BITS, BLOCK_N).to(Y.dtype.element_ty), mask=mask_n)
                if RESID:  # a sum of squares the next norm can read (its x is ablated too)
                    tl.store(SsOut + pid_n, 1.0)
            elif ABLATE & 4:  # the finish's atomic adds alone: the sum stays in the workspace, Y is not written
                tl.atomic_add(Acc + offs_n, _columns(acc_l, acc_h, BITS, BLOCK_N), mask=mask_n, sem="relaxed")
                if RESID:
                    tl.store(SsOut + pid_n, 1.0)
            else:
                _finish_splits(Acc, Count, Bias, Y, _columns(acc_l, acc_h, BITS, BLOCK_N), offs_n,
                               mask_n, pid_n, num_splits, HAS_BIAS, Res, SsOut, RESID, FIN)
            return
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
            in_k = offs_k < k_hi
            x = _load_x(X + offs_k, U + offs_k, in_k, GLU, r_norm, NORM)
            if NSEG > 1 and not SEG_ALIGNED:
                row_mask = (tl.abs(x)[:, None] > t_col[None, :]) & in_k[:, None] & mask_n[None, :]
            else:
                keep = (tl.abs(x) > t0) & in_k  # the fused threshold test
                if EVEN_N:
                    row_mask = keep[:, None]
                else:
                    row_mask = keep[:, None] & mask_n[None, :]
            # Masked lanes issue no load: a dropped row moves no bytes.
            w = tl.load(W + offs_k[:, None] * stride_wk + offs_n[None, :], mask=row_mask, other=0.0,
                        eviction_policy=EVICT)
            # Summed over the tile's rows at once: with BLOCK_N = 512 B * num_warps each thread
            # holds all BLOCK_K rows of its 8 columns, so this is in-thread adds and the
            # accumulator costs 8 registers, leaving registers for loads in flight.
            acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)  # (BLOCK_N,)
        _finish_splits(Acc, Count, Bias, Y, acc, offs_n, mask_n, pid_n, num_splits, HAS_BIAS, Res, SsOut, RESID, FIN)


@torch.library.custom_op("sparsedecode::sparse_gemv", mutates_args=())
def _sparse_gemv_op(
    x: Tensor, w_t: Tensor, thr_ts: list[Tensor], thr_f: float, bounds: list[int], bias: Tensor | None,
    ws_acc: Tensor | None, ws_count: Tensor | None,
    block_n: int, block_k: int, splits: int, num_warps: int, stages: int, up: Tensor | None = None,
    residual: Tensor | None = None, norm_w: Tensor | None = None, ss_in: Tensor | None = None, eps: float = 0.0,
) -> tuple[Tensor, Tensor]:
    # Declared pure although it writes the workspace: the kernel returns the workspace to
    # all-zero before it exits, so no caller can observe the writes, and torch.compile need
    # not functionalize (clone) a buffer that only serves as scratch. Host-side choices
    # (config from the SM count, PDL) run at trace and capture time and are static per shape.
    K, N = w_t.shape
    if not block_n:
        block_n, block_k, splits, num_warps, stages = default_config(K, N, x.dtype, x.device)
    if stages not in (1, 4, 8):  # from config= or a TUNED entry
        raise InputError(f"stages {stages} for ({K}, {N}): the kernel runs stages 1 (plain loop), 4 (two tiles in "
                         "flight) and 8 (a kept-row list, two tiles in flight); stages 2, 3, 5, 6, 7 and 9 to 12 "
                         "were measured slower on the H200 and removed (pass another config= or change the TUNED "
                         "entry)")
    fused = up is not None or residual is not None or norm_w is not None or len(thr_ts) > 1
    if ABLATE and (stages != 4 or bias is not None or (fused and not ABLATE & 2) or ABLATE & 5 == 5
                   or any(b % block_n for b in bounds)):
        raise InputError(f"sparse_gemv.ABLATE={ABLATE} (a timing ablation) applies to stages-4 calls without bias "
                         f"or segments off the tile grid, and to calls with up, residual, norm or segments only "
                         f"with the x ablation (bit 2: their kept rows would otherwise follow ablated inputs), bits 1 "
                         f"and 4 (no finish, its atomic adds alone) not together; "
                         f"this call runs stages {stages}{' with bias' if bias is not None else ''}"
                         f"{' fused' if fused else ''}")
    # with a residual, each column tile's sum of squares of the new residual stream (else empty)
    ss = torch.empty(triton.cdiv(N, block_n) if residual is not None else 0, device=x.device, dtype=torch.float32)
    splits = _splits(K, block_k, splits)
    if ws_acc is None or ws_count is None:
        ws_acc, ws_count = workspace(N, x.device, block_n)  # a memset: capturable, but a node more
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    n_tiles = triton.cdiv(N, block_n)
    thr = list(thr_ts) + [ws_acc] * (3 - len(thr_ts))  # unused pointer slots
    b1, b2 = (list(bounds) + [N, N])[:2]
    rows = _rows_per_split(K, block_k, splits)
    aligned = all(b % block_n == 0 for b in bounds)
    args = (x, w_t, bias if bias is not None else x, *thr, y, ws_acc, ws_count, thr_f, K, N, w_t.stride(0),
            b1, b2, rows, splits)
    # the meta-parameters every kernel takes
    shape = dict(BLOCK_N=block_n, BLOCK_K=block_k, THR_T=bool(thr_ts), NSEG=max(1, len(thr_ts)),
                 HAS_BIAS=bias is not None, EVEN_N=N % block_n == 0, num_warps=num_warps)
    # stages 8: each program's list of kept rows and their x, written before it is read, so never zeroed
    lists = 2 if stages == 8 else 0
    scratch = (torch.empty(n_tiles * splits * _pow2(rows) * lists, device=x.device, dtype=torch.int32) if lists
               else ws_acc)
    # bf16 read as int32 pairs (stages 4 and 8): N, the row stride and the base 4-byte aligned
    bits = (BF16_PAIRS and x.dtype == torch.bfloat16 and stages in (4, 8) and N % 2 == 0
            and w_t.stride(0) % 2 == 0 and w_t.data_ptr() % 4 == 0)
    cols = block_n // 2 if bits else block_n
    pdl = PDL and x.is_cuda and not _interpreting()
    cap = ({"maxnreg": max_registers(n_tiles * splits, num_warps, x.device)}
           if x.is_cuda and not _interpreting() else {})
    _sparse_gemv_kernel[(n_tiles, splits)](
        *args, Scratch=scratch, SEG_ALIGNED=aligned, stride_w32=w_t.stride(0) // 2,
        BITS=bits, COLS=cols, COMPACT=stages == 8, RPS=_pow2(rows), DBUF=stages in (4, 8),
        STRIDE=w_t.stride(0) if ROW_STRIDE_CONST and stages == 4 else 0, num_stages=1,  # stages 4 reads it
        ABLATE=ABLATE, FIN=finish_mode(num_warps),
        U=up if up is not None else norm_w if norm_w is not None else x, GLU=up is not None,
        Res=residual if residual is not None else x, SsOut=ss if residual is not None else ws_acc,
        SsIn=ss_in if ss_in is not None else ws_acc, n_ss=0 if ss_in is None else ss_in.numel(), eps=eps,
        RESID=residual is not None, NORM=norm_w is not None,
        SS_BLOCK=_pow2(max(1, 0 if ss_in is None else ss_in.numel())),
        EVICT="evict_first" if WEIGHTS_EVICT_FIRST else "", PDL=pdl, PDL_TRIGGER=PDL_TRIGGER,
        **cap, **({"launch_pdl": True} if pdl else {}), **shape)
    return y, ss


@_sparse_gemv_op.register_fake
def _(x, w_t, thr_ts, thr_f, bounds, bias, ws_acc, ws_count, block_n, block_k, splits, num_warps, stages,
      up=None, residual=None, norm_w=None, ss_in=None, eps=0.0):
    K, N = w_t.shape
    if not block_n:
        block_n = default_config(K, N, x.dtype, x.device)[0]
    return x.new_empty(N), x.new_empty(-(-N // block_n) if residual is not None else 0, dtype=torch.float32)


def _bounds(segments: list[int]) -> list[int]:
    """Column bounds between the blocks of a segmented weight."""
    return [sum(segments[:j + 1]) for j in range(len(segments) - 1)]


def sparse_gemv(
    x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None, config: tuple[int, int, int, int, int] | None = None,
    segments: list[int] | None = None, up: Tensor | None = None, *,
    residual: Tensor | None = None, norm: tuple[Tensor, Tensor, float] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Input-sparse GEMV of one token with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    x (..., K) holding one token; w_t (K, N), the weight transposed (unit stride along N; the
    row stride may exceed N, so a column slice of a concatenated weight works); threshold a
    float or a 1-element float tensor on x's device (read on the device, so a captured graph
    follows in-place updates); channel i is kept iff |x_i| > threshold. Returns (..., N) in
    x's dtype: sum over kept i of x_i * w_t[i, :] (+ bias), fp32 accumulation; rows of
    dropped channels are never loaded (§3.2).

    A concatenated weight (q|k|v, or gate|up) runs as one launch with one threshold per
    site: `segments` lists the widths of its 2 or 3 column blocks and `threshold` is a list
    of as many 1-element tensors; column block j keeps row i iff |x_i| > threshold[j].

    With `up` (x's shape, dtype and device) the input is SwiGLU's silu(x) * up, formed in the
    kernel's x load (x is the gate): the down projection then needs no separate
    silu-and-multiply launch, and its threshold applies to the product as in §3.2.

    `ws` is a persistent workspace from `workspace(N, device)` (without it each call zeroes
    a fresh one); `config` (BLOCK_N, BLOCK_K, splits, num_warps, stages) overrides
    `default_config`, for tuning (stages 1 is the plain loop; stages 4 keeps two tiles' weight
    loads in flight, the next x slice two tiles ahead; stages 8 first lists each split's kept
    rows and their x, then streams only those, two tiles in flight). The other loops measured
    on the H200 were slower and were removed (see NUM_STAGES).

    Fused RMSNorm, so a decoder layer's two norms need no kernels of their own:
    with `residual` (the output's shape and dtype) the call returns (residual + y, ss), the sum
    rounded to x's dtype after y is, as eager `x + proj(h)` rounds, and ss (float32, one per
    column tile) the tiles' sums of squares of that new residual stream. With `norm` =
    (weight (K,) in x's dtype, ss, eps) x is a residual stream whose sums of squares ss came
    from such a call, and the input is RMSNorm(x) = weight * (x / sqrt(mean(x^2) + eps)),
    rounded as `models.decoder.RMSNorm` rounds, formed in the kernel's x loads; the threshold
    applies to the normed input.
    """
    if triton is None:
        raise InputError("the sparse GEMV kernel needs Triton: pip install triton (or use sparse_gemv_ref)")
    thresholds = threshold if isinstance(threshold, (list, tuple)) else [threshold]
    if segments is not None or len(thresholds) > 1:
        if segments is None or len(segments) != len(thresholds) or not 2 <= len(segments) <= 3:
            raise InputError(
                f"a segmented call wants 2 or 3 column widths and one threshold per width; got "
                f"segments={segments} and {len(thresholds)} thresholds"
            )
        if sum(segments) != w_t.shape[-1] or min(segments) < 1:
            raise InputError(f"segments {segments} must be positive and sum to N={w_t.shape[-1]}")
        if not all(isinstance(t, Tensor) for t in thresholds):
            raise InputError("segment thresholds must be 1-element float tensors on x's device")
    for t in thresholds:
        K, N = check_inputs(x, w_t, t, bias)
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device):
        raise InputError(f"up must match the gate x: {tuple(x.shape)} {x.dtype} on {x.device}; got "
                         f"{tuple(up.shape)} {up.dtype} on {up.device}")
    if residual is not None and (residual.shape != (*x.shape[:-1], N) or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise InputError(f"residual must be the output's shape {(*x.shape[:-1], N)} in {x.dtype} on {x.device}; "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if norm is not None:
        if up is not None:
            raise InputError("norm= and up= do not combine: the norm's input is the residual stream")
        norm_w, ss, eps = norm
        if norm_w.shape != (K,) or norm_w.dtype != x.dtype or norm_w.device != x.device:
            raise InputError(f"the norm weight must be ({K},) in {x.dtype} on {x.device}; got "
                             f"{tuple(norm_w.shape)} {norm_w.dtype} on {norm_w.device}")
        if ss.dim() != 1 or ss.dtype != torch.float32 or ss.device != x.device or not 1 <= ss.numel() <= 4096:
            raise InputError(f"the norm's sums of squares must be float32 (1 to 4096,) on {x.device}, as "
                             f"sparse_gemv(residual=...) returns them; got {tuple(ss.shape)} {ss.dtype} on {ss.device}")
    if not (x.is_cuda or _interpreting()):
        raise InputError(
            "the sparse GEMV Triton kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1); "
            "use sparse_gemv_ref, the masked reference"
        )
    if w_t.stride(1) != 1 or w_t.stride(0) < N:
        raise InputError(
            f"w_t (K, N) must have unit stride along N and a row stride >= N (got strides {w_t.stride()}): "
            "the kernel skips whole rows; store the weight transposed once"
        )
    if K * w_t.stride(0) >= 2**31:
        raise InputError(f"a ({K}, {w_t.stride(0)}) weight exceeds the kernel's 32-bit offsets")
    if ws is not None and (ws[0].numel() < N or ws[0].dtype != torch.float32 or ws[1].dtype != torch.int32):
        raise InputError("ws must be workspace(N, device): (float32 (>= N,), int32 counters)")
    if config is not None:
        if len(config) != 5:
            raise InputError(f"config is (BLOCK_N, BLOCK_K, splits, num_warps, stages); got {config}")
        block_n, block_k, splits, num_warps, stages = config  # stages: checked by the op, as TUNED's
        if block_n & (block_n - 1) or block_k & (block_k - 1) or block_n < MIN_BLOCK or block_k < MIN_BLOCK_K:
            raise InputError(f"BLOCK_N and BLOCK_K must be powers of two, BLOCK_N >= {MIN_BLOCK} and "
                             f"BLOCK_K >= {MIN_BLOCK_K}; got {config}")
        if ws is not None and ws[1].numel() < -(-N // block_n):
            raise InputError(f"ws has {ws[1].numel()} counters; BLOCK_N={block_n} needs {-(-N // block_n)}")
    if isinstance(thresholds[0], Tensor):
        thr_ts, thr_f = [t.reshape(()) for t in thresholds], 0.0
    else:
        thr_ts, thr_f = [], float(thresholds[0])
    bounds = [] if segments is None else _bounds(segments)
    norm_w, ss_in, eps = norm if norm is not None else (None, None, 0.0)
    y, ss = _sparse_gemv_op(x.reshape(K), w_t, thr_ts, thr_f, bounds, bias, *(ws or (None, None)),
                            *(config or (0, 0, 0, 0, 0)), None if up is None else up.reshape(K),
                            None if residual is None else residual.reshape(N), norm_w, ss_in, float(eps))
    y = y.reshape(*x.shape[:-1], N)
    return y if residual is None else (y, ss)


def sumsq(x: Tensor) -> Tensor:
    """The float32 sum of squares of x, as a (1,) tensor: the partials `sparse_gemv(norm=...)`
    reads, for a residual stream that no `sparse_gemv(residual=...)` produced (the
    embedding's output before the first layer)."""
    return x.float().pow(2).sum().reshape(1)


def sparse_gemv_segments_ref(x: Tensor, w_t: Tensor, thresholds: list, segments: list[int],
                             bias: Tensor | None = None) -> Tensor:
    """Masked reference of a segmented `sparse_gemv`: each column block with its own threshold."""
    outs, lo = [], 0
    for t, width in zip(thresholds, segments, strict=True):
        b = None if bias is None else bias[lo:lo + width]
        outs.append(sparse_gemv_ref(x, w_t[:, lo:lo + width], t, b))
        lo += width
    return torch.cat(outs, dim=-1)


__all__ = [
    "TUNED", "default_config", "keep_mask", "load_tuned", "sparse_gemv", "sparse_gemv_ref",
    "sparse_gemv_segments_ref", "workspace",
]
