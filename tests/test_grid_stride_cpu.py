"""CPU tests of the DSL's elementwise walk and grid ids (dsl.Kernel.grid_stride, block_id("y"))
and of a row tile's pad value (dsl.RowTile loads, pad=-inf for a max): small kernels built
with kbuild.dsl and lowered to PTX for sm_90 and through ROCDL for gfx942 (to a code object
where llvmlite and an LLD are installed)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("mlir")

from kbuild.dsl import Kernel, RowTile, V, cast, get_llvm_ptr, load, store, to_f32  # noqa: E402
from kbuild.plan.config import choose_row_config  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx  # noqa: E402

SM90 = target_for_arch("sm_90")
GFX942 = target_for_arch("gfx942")
VEC = 8  # bf16 elements in 16 bytes


def scale_kernel(target, block: int = 256) -> Kernel:
    """y = 2 * x over a batch of arrays of n 16-byte vectors each: the array is block_id("y"),
    its vectors are walked grid-stride over x."""
    with Kernel("scale", target, block) as k:
        x, y = k.ptr("x"), k.ptr("y")
        n = k.i64("n")  # vectors per array
        base = k.block_id("y") * n

        def body(i: V, carried: list[V]) -> list[V]:
            at = (base + i) * VEC
            value = to_f32(load(get_llvm_ptr(x, at, "bf16"), "bf16", VEC)) * 2.0
            store(cast(value, "bf16"), get_llvm_ptr(y, at, "bf16"))
            return carried

        k.grid_stride(n, body)
    return k


def count_kernel(target) -> Kernel:
    """Carried values: each thread counts the items it took (written to out[global id])."""
    with Kernel("count", target, 128) as k:
        out, n = k.ptr("out"), k.i64("n")
        (taken,) = k.grid_stride(n, lambda i, c: [c[0] + 1], [cast(k.thread_id() * 0, "i64")])
        store(taken, get_llvm_ptr(out, k.block_id() * k.block + k.thread_id(), "i64"))
    return k


def _ptx(kernel: Kernel) -> str:
    return module_to_ptx(kernel.module, SM90).decode()


def test_grid_stride_walks_from_the_global_id_by_the_grid_threads():
    ptx = _ptx(scale_kernel(SM90))
    # start = ctaid.x * 256 + tid.x; step = nctaid.x * 256; the array from ctaid.y.
    for register in ("%ctaid.x", "%tid.x", "%nctaid.x", "%ctaid.y"):
        assert register in ptx
    # One 16-byte load and store in the loop body, and a branch back to its head.
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 1
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 1
    assert re.search(r"setp\.(lt|ge|gt|le)\.[us]64", ptx) and "bra" in ptx


def test_grid_stride_carries_values_out_of_the_walk():
    ptx = _ptx(count_kernel(SM90))
    assert "st.global.u64" in ptx or "st.global.b64" in ptx


def test_grid_ids_take_x_y_or_z_only():
    with Kernel("dims", SM90, 32) as k:
        for dim in "xyz":
            k.block_id(dim), k.grid_size(dim)
        with pytest.raises(ValueError, match="a grid dimension is 'x', 'y' or 'z', not 'w'"):
            k.block_id("w")


def _lowered_for_amd(kernel: Kernel) -> str:
    from mlir import passmanager

    pipeline = GFX942.pipeline.replace(", gpu-module-to-binary{format=isa}", "")
    with kernel.context:
        passmanager.PassManager.parse(pipeline).run(kernel.module.operation)
        return str(kernel.module)


@pytest.mark.parametrize("make", [scale_kernel, count_kernel], ids=["scale", "count"])
def test_grid_stride_kernels_lower_for_gfx942(make):
    kernel = make(GFX942)
    text = _lowered_for_amd(kernel)
    assert "rocdl.workgroup.id.x" in text and "nvvm" not in text
    if make is scale_kernel:
        assert "rocdl.workgroup.id.y" in text
    llvmlite = pytest.importorskip("llvmlite")
    assert llvmlite
    from kbuild.targets import amd

    try:
        binary = amd.llvm_ir_to_hsaco(amd.module_to_llvm_ir(text), GFX942.arch)
    except amd.AmdToolchainMissing as err:
        pytest.skip(str(err))
    amd.check_code_object(binary, GFX942.arch, kernel.name, kernel.signature())


# ---------------------------------------------------------------------- a row tile's pad


def row_max_kernel(target, pad: float | None) -> Kernel:
    """The max of each row of 1000 bf16 (125 vectors over 32 threads: the last vectors of a
    row lie past its end), merged by arith.maximumf: the padding must be -inf for it."""
    from mlir import ir
    from mlir.dialects import arith, vector

    def merge(a: list[V], b: list[V]) -> list[V]:
        return [V(arith.maximumf(u.value, v.value)) for u, v in zip(a, b, strict=True)]

    def lanes_max(v: V) -> V:
        kind = vector.CombiningKind.MAXIMUMF
        return V(vector.reduction(ir.F32Type.get(), kind, to_f32(v).value))

    cfg = choose_row_config(1000, "bf16", target.warp_size)
    assert not cfg.exact  # some columns lie past the row
    with Kernel("row_max", target, cfg.block) as k:
        x, out, rows = k.ptr("x"), k.ptr("out"), k.i64("M")
        t = RowTile(k, cfg, rows)
        values = t.load(x, "bf16") if pad is None else t.load(x, "bf16", pad=pad)
        best = [lanes_max(values[0])]
        for v in values[1:]:
            best = merge(best, [lanes_max(v)])
        (row_max,) = t.reduce(best, merge)
        t.store_row_scalar(out, row_max)
    return k


def _else_constants(kernel: Kernel) -> list[str]:
    with kernel.context:
        text = str(kernel.module)
    # The padding: a bf16 constant (broadcast to the vector) in each guarded load's else.
    return re.findall(r"arith\.constant (\S+) : bf16", text)


def test_row_loads_pad_with_zero_by_default_and_with_the_value_asked():
    default = row_max_kernel(SM90, None)
    assert set(_else_constants(default)) == {"0.000000e+00"}
    minus_inf = row_max_kernel(SM90, float("-inf"))
    assert set(_else_constants(minus_inf)) == {"0xFF80"}  # bf16 -inf
    ptx = _ptx(minus_inf)
    assert "max.f32" in ptx or "max.NaN.f32" in ptx


def test_a_padded_row_max_lowers_for_gfx942():
    kernel = row_max_kernel(GFX942, float("-inf"))
    assert "rocdl" in _lowered_for_amd(kernel)
