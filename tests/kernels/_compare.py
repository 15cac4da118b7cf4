"""Element-wise comparison for kernel tests: failures say how many elements are off and where."""

import math

import torch


def mismatch(got, want, tol, what) -> str | None:
    """None when |got - want| <= tol everywhere (equal infinities match), else a message with
    the count, the worst index and its values, and the first indices off."""
    got, want = got.double().cpu(), want.double().cpu()
    both_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    err = (got - want).abs().masked_fill(both_inf, 0.0).nan_to_num(math.inf)
    bad = err > tol
    if not bad.any():
        return None
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    first = [tuple(int(j) for j in i) for i in bad.nonzero()[:5]]
    return (
        f"{what}: {int(bad.sum())} of {err.numel()} elements off by more than {tol:.3g} "
        f"(max {err.max().item():.3g} at {worst}: got {got[worst].item():.6g}, want "
        f"{want[worst].item():.6g}); first off at {first}"
    )
