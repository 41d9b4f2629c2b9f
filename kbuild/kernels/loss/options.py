"""What kbuild.cross_entropy and kbuild.linear_cross_entropy share: their options' checks, the
kernel's coefficients, which rows count, the reductions and the z-loss term reported beside
the loss (the definitions: kbuild/kernels/loss/cross_entropy.py)."""

from __future__ import annotations

import math

import torch

REDUCTIONS = ("mean", "sum", "none")


def check_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap) -> None:
    """The options cross_entropy and linear_cross_entropy share, each named when refused."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    for name, value, high in (("label_smoothing", label_smoothing, 1.0),
                              ("lse_square_scale", lse_square_scale, math.inf)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {value!r}")
        if not (0.0 <= value <= high) or math.isnan(value) or math.isinf(value):
            limit = "in [0, 1]" if high == 1.0 else "finite and >= 0"
            raise ValueError(f"{name} must be {limit}; got {value}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be None or a float, got {softcap!r}")
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be None or finite and > 0; got {softcap}")


# (device, eps, z, cap) -> (coefs for a scale of 1, the mask of coefs[0], an fp32 1), made once
_CONSTANTS: dict = {}


def switches(
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float | None
) -> tuple:
    """The forward kernel's options as the ops take them: ignore_index and the compile-time
    switches of the smoothing, z-loss and soft-cap terms."""
    return ignore_index, label_smoothing > 0, lse_square_scale > 0, softcap is not None


def valid_rows(target: torch.Tensor, ignore_index: int, V: int) -> torch.Tensor:
    """Which rows count: a target in [0, V) that is not ignore_index (the kernel treats any
    other as ignored, reported or not). In [0, V) is `target // V == 0` (floor division: a
    negative id gives -1), one launch fewer than two bounds."""
    valid = torch.div(target, V, rounding_mode="floor") == 0
    return valid & (target != ignore_index) if 0 <= ignore_index < V else valid


def make_coefs(target: torch.Tensor, ignore_index: int, mean: bool, label_smoothing: float,
               lse_square_scale: float, softcap: float | None, V: int):  # fmt: skip
    """The kernels' coefs (gradient scale, label smoothing, z-loss scale, soft cap) on
    target's device, and n_valid (a device tensor) for a mean, else None. The constant part
    is made once per device and value (no host-to-device copy per call, so a call can be
    captured into a CUDA graph); a mean's scale 1 / n_valid is counted on the device, in
    four launches (each is host time on a call that is host-bound at small vocabularies)."""
    key = (target.device, float(label_smoothing), float(lse_square_scale), float(softcap or 0))
    constants = _CONSTANTS.get(key)
    if constants is None:
        values = torch.tensor((1.0, *key[1:]), dtype=torch.float32)
        first = torch.tensor([True, False, False, False])
        one = torch.tensor(1.0, dtype=torch.float32)
        constants = tuple(t.to(target.device) for t in (values, first, one))
        if len(_CONSTANTS) < 64:
            _CONSTANTS[key] = constants
    values, first, one = constants
    if not mean:
        return values, None
    n_valid = torch.count_nonzero(valid_rows(target, ignore_index, V))
    return torch.where(first, one / n_valid, values), n_valid  # (fp32 whatever the default)


def reduce_rows(rows: torch.Tensor, target: torch.Tensor, reduction: str, n_valid) -> torch.Tensor:
    if reduction == "none":
        return rows.view(target.shape)
    total = rows.sum()
    return total / n_valid if reduction == "mean" else total


def z_loss_of(lse, target, ignore_index, z, reduction, dtype, V) -> torch.Tensor:
    """The z-loss part of a loss, z lse^2 over the rows that count (`valid_rows`), reduced as
    the loss is, in `dtype` (for logging: no gradient)."""
    lse = lse.detach()
    valid = valid_rows(target.reshape(-1), ignore_index, V)
    rows = torch.where(valid, z * lse * lse, 0.0)
    n_valid = valid.sum() if reduction == "mean" else None
    return reduce_rows(rows, target, reduction, n_valid).to(dtype)
