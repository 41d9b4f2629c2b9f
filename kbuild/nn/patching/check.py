"""The numerical check every swap of `kbuild.nn.patching` passes first: run the stock computation
and kbuild's on a probe, on the module's own device and in its own dtype, and compare.

A verdict is a reason string (why the swap is refused) or None (they agree)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# |ours - stock| <= atol * scale + rtol * |stock|, scale the probe output's RMS (module checks)
# or 1 (function checks on inputs of fixed range). 16-bit: a few ulps, since the stock modules
# round each intermediate to the I/O dtype and kbuild rounds once. The mismatches this must see
# (another activation, gate and up exchanged, interleaved rotation) are O(0.1) or more.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (8e-3, 8e-3),
    torch.bfloat16: (4e-2, 4e-2),
}
# An activation read in fp32 over [-10, 10]: tight enough that tanh-GELU is not taken for erf-GELU
# (they differ by up to 3e-4 there), loose enough for fp32 exp and tanh approximations.
ACT_TOL = (2e-5, 2e-5)


def mismatch(ours, stock, tol: tuple[float, float], scaled: bool = True) -> str | None:
    """Why `ours` is not `stock` (tensors or tuples of tensors), or None where they agree."""
    if isinstance(stock, tuple) != isinstance(ours, tuple):
        return "returns another structure than stock"
    if isinstance(stock, tuple):
        if len(stock) != len(ours):
            return "returns another number of outputs than stock"
        for a, b in zip(ours, stock, strict=True):
            if (reason := mismatch(a, b, tol, scaled)) is not None:
                return reason
        return None
    if not isinstance(ours, torch.Tensor) or not isinstance(stock, torch.Tensor):
        return "returns no tensor"
    if ours.shape != stock.shape or ours.dtype != stock.dtype:
        return (
            f"returns {tuple(ours.shape)} {ours.dtype} where stock returns "
            f"{tuple(stock.shape)} {stock.dtype}"
        )
    a, b = ours.detach().double(), stock.detach().double()
    if not bool(torch.isfinite(b).all()):
        return "inconclusive: stock is not finite on the probe"
    scale = b.square().mean().sqrt().item() if scaled else 1.0
    if scaled and scale == 0.0:
        return "inconclusive: stock is zero on the probe (zero weights?)"
    rtol, atol = tol
    err = (a - b).abs()
    bad = ~(err <= atol * scale + rtol * b.abs())  # NaN in ours counts as bad
    if bool(bad.any()):
        worst = err.nan_to_num(float("inf")).max().item() / scale
        what = "max |diff| / rms" if scaled else "max |diff|"
        return f"differs from stock on the probe ({what} {worst:.3g}; tolerance {atol:g})"
    return None


def compare(
    stock: Callable[[], object], ours: Callable[[], object], tol, scaled: bool = True
) -> str | None:
    """Run both under no_grad and compare (`mismatch`); an exception becomes the reason
    (kbuild's missing offline kernel excepted: that must be said, never silently skipped)."""
    from ...jit import KernelNotCached

    with torch.no_grad():
        try:
            theirs = stock()
        except Exception as e:
            return f"stock raised on the probe ({type(e).__name__}: {_short(e)})"
        try:
            mine = ours()
        except KernelNotCached:
            raise
        except Exception as e:
            return f"kbuild raised on the probe ({type(e).__name__}: {_short(e)})"
    return mismatch(mine, theirs, tol, scaled)


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:160] if text else "") or "no message"


def where(module: torch.nn.Module) -> tuple[torch.device, torch.dtype] | str:
    """The device and dtype of the module's first parameter, or why the module cannot be
    checked (none, meta, a dtype kbuild does not take)."""
    param = next(module.parameters(), None)
    if param is None:
        return "no parameters to take a device and dtype from"
    if param.device.type == "meta":
        return "on the meta device: nothing to check on"
    if param.dtype not in TOL:
        return f"dtype {param.dtype} is not one kbuild computes in"
    return param.device, param.dtype


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode (dropout off, so stock and kbuild see the same thing) for the
    check, every submodule's training flag restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
