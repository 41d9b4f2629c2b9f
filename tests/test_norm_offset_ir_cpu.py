"""Gemma's weight offset is added in fp32, to the widened weight, in the forward norm kernels
(kbuild/kernels/norms/forward.py): read off the emitted MLIR on CPU (no GPU).

y = x_hat * (offset + w) with a 16-bit w: adding the offset in 16 bits first rounds
offset + w to bf16 (8 bits of mantissa: w = 0.01 with offset 1.0 becomes 1.0078125, the
weight's own information mostly gone), which the torch reference (fp32 math) and the
backward (which adds it in fp32) do not do. Every add of the offset constant must be an f32
add whose other operand is the weight widened from 16 bits (arith.extf), on each of the
kernel's paths: a row per block, weights held in registers by a persistent grid, chunked
rows, and the fused add + RMSNorm.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("mlir")

from kbuild.compiler import build  # noqa: E402
from kbuild.spec import KernelSpec  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402

# "%name = op operands : types" (one SSA result; enough for the ops traced here)
_OP = re.compile(r"^\s*(%[\w.#]+) = ([\w.]+) (.*)$")
_CONST = re.compile(r"^([-+0-9.e]+) : (\w+)$")

CASES = {
    "row per block": ("rmsnorm_fwd", 1024, {}),
    "weights held in registers": ("rmsnorm_fwd", 16384, {"resident_params": "registers"}),
    "chunked rows": ("rmsnorm_fwd", 262144, {}),
    "fused add": ("fused_add_rmsnorm_fwd", 4096, {"residual_dtype": "bf16"}),
}


def _kernel_ir(kernel: str, N: int, dtype: str, offset: float, extra: dict) -> str:
    values = dict(N=N, dtype=dtype, weight_dtype=dtype, eps=1e-6, offset=offset, **extra)
    if kernel == "rmsnorm_fwd":
        values["store_rstd"] = False
    if kernel == "fused_add_rmsnorm_fwd":
        values["store_rstd"] = False
        values["residual_dtype"] = dtype
    spec = KernelSpec.make(kernel, **values)
    return str(build(spec, target_for_arch("sm_90")).module)


def offset_adds(ir: str, offset: float) -> list[tuple[str, str, str]]:
    """Each add of the constant `offset` (a scalar, or broadcast to a vector): (its result
    type, the op defining its other operand, that op's text)."""
    defs: dict[str, tuple[str, str]] = {}
    for line in ir.splitlines():
        m = _OP.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))

    def is_offset(name: str) -> bool:
        op, rest = defs.get(name, ("", ""))
        if op == "vector.broadcast":
            return is_offset(rest.split()[0])
        c = _CONST.match(rest)
        return op == "arith.constant" and c is not None and float(c.group(1)) == offset

    found = []
    for op, rest in defs.values():
        if op != "arith.addf":
            continue
        operands, _, result_type = rest.rpartition(" : ")
        a, b = (s.strip() for s in operands.split(","))
        for mine, other in ((a, b), (b, a)):
            if is_offset(mine):
                other_op, other_rest = defs.get(other, ("(argument)", ""))
                found.append((result_type.strip(), other_op, other_rest))
    return found


def check_offset_is_added_widened(ir: str, offset: float, dtype: str) -> None:
    adds = offset_adds(ir, offset)
    assert adds, "no add of the offset in the kernel"
    for result_type, other_op, other in adds:
        element = result_type.removeprefix("vector<").rstrip(">").split("x")[-1]
        assert element == "f32", f"the offset is added in {result_type}"
        assert other_op == "arith.extf" and dtype in other and "to" in other, (
            f"the offset is added to {other_op} {other}, not to the weight widened from {dtype}"
        )


@pytest.mark.parametrize("offset", [1.0, 0.8125])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("case", CASES)
def test_the_offset_is_added_to_the_widened_weight_in_fp32(case, dtype, offset):
    """Catches the offset added to the stored 16-bit weight before it is widened (a bf16 add:
    offset + w rounded to 8 mantissa bits), on any of the kernel's paths."""
    kernel, N, extra = CASES[case]
    check_offset_is_added_widened(_kernel_ir(kernel, N, dtype, offset, extra), offset, dtype)


# What the kernel would emit with the add before the widening, as norm_forward.py's
#     w = widen([wi + p.offset for wi in param(t, "weight", start)])
# writes it (the operations of the row-per-block kernel around its first offset add).
ADDED_BEFORE_WIDENING = """
      %89 = llvm.load %88 {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16>
      %cst_24 = arith.constant 1.000000e+00 : bf16
      %103 = vector.broadcast %cst_24 : bf16 to vector<8xbf16>
      %104 = arith.addf %89, %103 : vector<8xbf16>
      %99 = arith.extf %104 : vector<8xbf16> to vector<8xf32>
      %111 = arith.mulf %73, %99 : vector<8xf32>
"""


def test_the_check_fails_on_an_add_before_the_widening():
    """The check itself: it refuses the IR of the add done in bf16 before the widening (and
    passes the same lines in the right order)."""
    with pytest.raises(AssertionError, match="added in vector<8xbf16>"):
        check_offset_is_added_widened(ADDED_BEFORE_WIDENING, 1.0, "bf16")
    right = """
      %89 = llvm.load %88 {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16>
      %99 = arith.extf %89 : vector<8xbf16> to vector<8xf32>
      %cst_24 = arith.constant 1.000000e+00 : f32
      %103 = vector.broadcast %cst_24 : f32 to vector<8xf32>
      %104 = arith.addf %99, %103 : vector<8xf32>
"""
    check_offset_is_added_widened(right, 1.0, "bf16")
