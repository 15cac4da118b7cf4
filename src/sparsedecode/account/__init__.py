"""The byte account of a decode step (ByteCross §3.1-3.3, §4.3, §5.2, App. A, App. C).

From model dimensions and keep ratios alone: the bytes one decode step reads,
the crossover n* at which activation sparsity and KV-cache sparsity remove
equal bytes, its batched, fixed-budget, precision-scaled and quality-matched
variants, the ideal speedup bound of each branch and of both, the latency
crossing once kernel costs are known, and the effective keep of token routing
(SATS paper §3.2). Pure Python: imports neither torch nor numpy, so it answers
instantly and runs anywhere.
"""

from sparsedecode.account.crossover import (
    Bounds,
    bounds,
    crossover,
    crossover_batched,
    crossover_fixed_budget,
    kv_gap_growth_ms_per_k,
    latency_crossing,
    round_tokens,
)
from sparsedecode.account.dims import ModelDims, load_config, resolve_dims
from sparsedecode.account.known import KNOWN_MODELS, KnownModel, known_model
from sparsedecode.account.matched import MatchedCrossover, admissible_keep, matched_crossover
from sparsedecode.account.routed import check_routed, routed_keep
from sparsedecode.account.traffic import (
    StepBytes,
    kv_saving,
    projection_saving,
    step_bytes,
    traffic_table,
)
from sparsedecode.account.units import K, parse_curve, parse_token_list, parse_tokens

__all__ = [
    "K",
    "KNOWN_MODELS",
    "Bounds",
    "KnownModel",
    "MatchedCrossover",
    "ModelDims",
    "StepBytes",
    "admissible_keep",
    "bounds",
    "check_routed",
    "crossover",
    "crossover_batched",
    "crossover_fixed_budget",
    "known_model",
    "kv_gap_growth_ms_per_k",
    "kv_saving",
    "latency_crossing",
    "load_config",
    "matched_crossover",
    "parse_curve",
    "parse_token_list",
    "parse_tokens",
    "projection_saving",
    "resolve_dims",
    "round_tokens",
    "routed_keep",
    "step_bytes",
    "traffic_table",
]
