"""CPU tests of the row pipelining options: a persistent forward grid, rows staged in shared
memory by asynchronous copies (`stage`), the backward's next rows asked into L2
(`prefetch_l2`) and w (and b) held in registers (`resident_params`). The plans that choose
them are tested without MLIR in test_plans_cpu.py.

What they compute is checked on the GPU (tests/test_layernorm_gpu.py and the RMSNorm GPU
tests run the staged kernels the chooser picks); here the PTX they generate, the launch
facts the runtime reads, and the errors for options a target cannot honour.
"""

from __future__ import annotations

import functools
import re

import pytest

pytest.importorskip("mlir")  # the kernel modules import MLIR

from kbuild import compiler  # noqa: E402
from kbuild.compiler import CompileError  # noqa: E402
from kbuild.op.launch import rows_grid  # noqa: E402
from kbuild.spec import KernelSpec  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx  # noqa: E402

LN_FWD = dict(dtype="bf16", weight_dtype="bf16", bias_dtype="bf16", store_stats=True, eps=1e-5)
LN_BWD = dict(dtype="bf16", weight_dtype="bf16", compute_dw=True, compute_db=True)


def _spec(kernel: str, N: int, **kwargs) -> KernelSpec:
    base = LN_FWD if kernel == "layernorm_fwd" else LN_BWD
    return KernelSpec.make(kernel, N=N, vectorize=True, **{**base, **kwargs})


@functools.cache
def _ptx_and_meta(spec: KernelSpec, arch: str = "sm_90") -> tuple[str, dict]:
    target = target_for_arch(arch)
    kernel = compiler.build(spec, target)
    meta = dict(kernel.meta, static_shared_bytes=kernel.shared_bytes)
    return module_to_ptx(kernel.module, target).decode(), meta


def _build_error(spec: KernelSpec, arch: str) -> str:
    with pytest.raises((ValueError, CompileError)) as info:
        compiler.build(spec, target_for_arch(arch))
    return str(info.value)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("N", [16384, 65536])
def test_staged_forward_copies_the_rows_ahead_and_waits_for_the_oldest(N, depth):
    ptx, meta = _ptx_and_meta(_spec("layernorm_fwd", N, persistent=True, stage=depth))
    assert meta["grid"] == "persistent"
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16;", ptx)
    # Each thread copies its vectors of the first `depth` groups, then one group per step.
    assert len(copies) == 4 * (depth + 1)
    # A step waits for its own group only: the `depth - 1` younger ones stay in flight.
    waits = re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)
    assert str(depth - 1) in waits and waits[-1] == "0"  # the last drains before exit


def test_staged_backward_stages_x_and_dy():
    ptx, meta = _ptx_and_meta(_spec("layernorm_bwd", 65536, stage=2))
    assert meta["grid"] == "persistent" and meta["cluster"] == 8
    # x and dy: 2 vectors each per thread, for 2 groups ahead and once per step.
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == 2 * 2 * 3
    assert re.search(r"cp\.async\.wait_group\s+1;", ptx)


def test_l2_prefetch_is_one_bulk_request_per_array():
    ptx, _ = _ptx_and_meta(_spec("layernorm_bwd", 16384, prefetch_l2=True))
    assert len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)) == 2  # x and dy


@pytest.mark.parametrize(
    "kernel, N, options, words",
    [
        ("layernorm_fwd", 65536, dict(persistent=True, stage=1, blocks_per_sm=3), 32),
        ("layernorm_bwd", 65536, {}, 8),
    ],
)
def test_parameters_held_in_registers_are_read_once_and_widened_in_the_loop(
    kernel, N, options, words
):
    ptx, _ = _ptx_and_meta(_spec(kernel, N, resident_params=False, **options))
    held, _ = _ptx_and_meta(_spec(kernel, N, resident_params="registers", **options))
    # Both stage their rows: the row loop begins with the wait for the first staged group.
    loop = held.index("cp.async.wait_group")
    before, body = held[:loop], held[loop:]
    # The forward's w and b (4 vectors each), the backward's w (2 vectors): read before the
    # loop, never in it; the loop reads only the staged rows and the row stats.
    params = 8 if kernel == "layernorm_fwd" else 2
    assert len(re.findall(r"ld\.global\.v4\.b32", before)) == params
    assert not re.findall(r"ld\.global\.v4\.b32", body)
    # Each held word passes through one opaque move per row, so the fp32 widening (the
    # shifts of the bf16 halves) stays inside the loop instead of taking twice the registers.
    plain_body = ptx[ptx.index("cp.async.wait_group") :]
    assert body.count("mov.b32") - plain_body.count("mov.b32") == words
    assert len(re.findall(r"shl\.b32", body)) >= len(re.findall(r"shl\.b32", before))


@pytest.mark.parametrize(
    "kernel, params, held, min_blocks",
    [
        # Rows split over a cluster (N = 65536 unless given): 16-bit parameters held, with
        # room for 3 blocks per SM in the forward, 2 in the backward.
        ("layernorm_fwd", {}, True, 3),
        ("layernorm_fwd", dict(bias_dtype=None), True, 3),
        ("layernorm_fwd", dict(weight_dtype="f32", bias_dtype="f32"), False, 4),
        ("layernorm_fwd", dict(weight_dtype=None, bias_dtype=None), False, 4),
        ("layernorm_bwd", {}, True, 2),
        ("layernorm_bwd", dict(N=16384), True, 2),
        ("layernorm_bwd", dict(weight_dtype="f32"), False, 2),
        # f16 rows are widened as fp32 copies and already fill the register cap.
        ("layernorm_bwd", dict(dtype="f16", weight_dtype="f16"), False, 2),
    ],
)
def test_the_chooser_holds_16_bit_parameters_of_cluster_rows_in_registers(
    kernel, params, held, min_blocks
):
    params = {"N": 65536, **params}
    ptx, _ = _ptx_and_meta(_spec(kernel, **params))
    before = ptx[: ptx.index("cp.async.wait_group")]
    assert bool(re.search(r"ld\.global\.v4\.b32", before)) == held
    assert re.search(rf"\.minnctapersm\s+{min_blocks}\b", ptx)


def test_shorter_rows_keep_reading_their_parameters():
    # The forward at 16384: one block per row; 131072: 512-thread blocks, which held
    # parameters would leave at one block per SM. (The backward at 16384 splits its rows over
    # two 512-thread blocks and holds w, as at 65536.)
    for kernel, N in (("layernorm_fwd", 16384), ("layernorm_fwd", 131072)):
        ptx, _ = _ptx_and_meta(_spec(kernel, N))
        assert "cp.async.wait_group" not in ptx or not re.search(
            r"ld\.global\.v4\.b32", ptx[: ptx.index("cp.async.wait_group")]
        )


@pytest.mark.parametrize(
    "kernel, options, message",
    [
        ("layernorm_fwd", dict(persistent=True, resident_params="l1"), "resident_params must"),
        # Shared-memory parameters (and their alias True) lost to registers and to reading
        # them per row (h200_tune_held_params.json, h200_tune_exchange.json): gone.
        ("layernorm_fwd", dict(resident_params="shared"), "resident_params must be None, False"),
        ("layernorm_fwd", dict(resident_params=True), "resident_params must be None, False or"),
        ("layernorm_bwd", dict(resident_params="shared"), "resident_params must be None, False or"),
    ],
)
def test_unknown_resident_params_raise(kernel, options, message):
    assert message in _build_error(_spec(kernel, 65536, **options), "sm_90")


def test_dynamic_shared_arrays_are_laid_out_one_after_another():
    # dw and db partials (64 KB), x staged two rows ahead (32 KB, static), then dy (32 KB):
    # the partials and dy in the dynamic array, the second where the first ends.
    ptx, meta = _ptx_and_meta(_spec("layernorm_bwd", 65536, stage=2))
    assert meta["dynamic_shared_bytes"] == 2 * 8192 * 4 + 2 * 2 * 8 * 512 * 2
    assert "__dynamic_smem" in ptx


def test_each_dynamic_shared_array_starts_16_byte_aligned_after_the_last():
    from kbuild.dsl import Kernel

    with Kernel("probe", target_for_arch("sm_90"), block=32) as k:
        first = k.dynamic_shared(5)  # 20 bytes, rounded up to 32
        second = k.dynamic_shared(8, "bf16")
        third = k.dynamic_shared(1, "i8")
        assert k.meta["dynamic_shared_bytes"] == 32 + 16 + 16
        offsets = [str(v.value.owner) for v in (second, third)]
    assert "llvm.mlir.addressof @__dynamic_smem" in str(first.value.owner)
    text = str(k.module)
    assert "arith.constant 32 : i64" in text and "arith.constant 48 : i64" in text
    for offset in (32, 48):
        assert re.search(rf"llvm\.getelementptr %\d+\[%c{offset}_i64\] .*, i8\n", text)
    assert len(offsets) == 2


def test_persistent_forward_launches_the_resident_grid():
    _, meta = _ptx_and_meta(_spec("layernorm_fwd", 65536, persistent=True, stage=1))

    class Launcher:
        rows_per_block, cluster, resident_clusters = 1, meta["cluster"], 62

    Launcher.meta = meta
    assert rows_grid(Launcher, 1024) == 62 * 8
    assert rows_grid(Launcher, 5) == 5 * 8  # never more clusters than rows


@pytest.mark.parametrize(
    "kernel, options, arch, message",
    [
        ("layernorm_fwd", dict(persistent=False, stage=1), "sm_90", "stage needs a persistent"),
        ("layernorm_fwd", dict(persistent=True, stage=1), "gfx942", "asynchronous copies"),
        ("layernorm_bwd", dict(stage=1), "gfx942", "asynchronous copies"),
        ("layernorm_bwd", dict(prefetch_l2=True), "sm_80", "Hopper or later"),
        (
            "layernorm_fwd",
            dict(persistent=False, resident_params="registers"),
            "sm_90",
            "resident_params='registers' needs a persistent grid",
        ),
    ],
)
def test_options_a_target_or_grid_cannot_honour_raise(kernel, options, arch, message):
    assert message in _build_error(_spec(kernel, 16384, **options), arch)


def test_shared_memory_past_the_targets_limit_is_a_build_error():
    # Four staged rows of 64 KB each: past the 227 KB an sm_90 block may have.
    spec = _spec("layernorm_fwd", 32768, persistent=True, stage=4)
    message = _build_error(spec, "sm_90")
    assert "bytes of shared memory per block; sm_90 allows 232448" in message


def test_staged_kernels_assemble_without_spills():
    from kbuild.targets.nvidia import ptxas_path

    if ptxas_path() is None:
        pytest.skip("ptxas not found")
    for spec in (
        _spec("layernorm_fwd", 16384, persistent=True, stage=1),
        _spec("layernorm_fwd", 65536, persistent=True, stage=2),
        _spec("layernorm_bwd", 65536, stage=2),
    ):
        artifact = compiler.compile_kernel(spec, target_for_arch("sm_90"))
        assert artifact.meta["spill_stores"] == 0, spec.short()


@pytest.mark.parametrize(
    "spec, arch, staged",
    [
        (_spec("layernorm_fwd", 16384), "sm_90", True),  # a whole 512-thread block per row
        (_spec("layernorm_fwd", 65536), "sm_90", True),  # split over a cluster
        (_spec("layernorm_fwd", 8192), "sm_90", False),  # short rows: one block per row
        (_spec("layernorm_fwd", 16384), "gfx942", False),  # no asynchronous copies
        (_spec("layernorm_bwd", 65536), "sm_90", True),  # 512-thread blocks of a cluster
        (_spec("layernorm_bwd", 16384), "sm_90", True),  # 2 x 512 threads (8 x 128: worse)
        (_spec("layernorm_bwd", 16384, cluster=8), "sm_90", False),  # 128-thread blocks
        (_spec("layernorm_bwd", 65536), "sm_80", False),  # no clusters: chunked rows
    ],
)
def test_the_chooser_stages_where_it_was_measured_to_win(spec, arch, staged):
    target = target_for_arch(arch)
    kernel = compiler.build(spec, target)
    text = str(kernel.module)
    assert ("nvvm.cp.async.shared.global" in text) == staged
    if spec.kernel == "layernorm_fwd":
        assert kernel.meta["grid"] == ("persistent" if staged else "rows")


def test_the_fused_backward_stages_its_longest_rows():
    from kbuild.kernels.norms.rmsnorm import fused_add_rmsnorm_bwd_spec

    for N, staged in ((65536, True), (16384, True), (4096, False)):
        spec = fused_add_rmsnorm_bwd_spec(N, "bf16", "bf16", "bf16", True, True)
        text = str(compiler.build(spec, target_for_arch("sm_90")).module)
        assert ("nvvm.cp.async.shared.global" in text) == staged, N


def test_blocks_per_sm_sets_the_occupancy_hint():
    ptx, _ = _ptx_and_meta(_spec("layernorm_fwd", 65536, persistent=True, stage=1, blocks_per_sm=3))
    assert ".minnctapersm 3" in ptx


def test_row_kernels_take_blocks_per_sm_only_when_given():
    """row_kernel (cross-entropy, softmax, the activations) puts a given `blocks_per_sm` into
    the kernel, and no cap otherwise. Catches the keyword accepted by the plan and dropped
    before the kernel (it was), and the chooser's cap, which spilled 40 of those kernels,
    coming back as a default."""
    from kbuild.kernels.loss.kernels import build_cross_entropy_fwd

    target = target_for_arch("sm_90")

    def module(**extra):
        spec = build_cross_entropy_fwd.spec(N=4096, dtype="bf16", index_dtype="i64", **extra)
        return str(compiler.build(spec, target).module)

    capped, plain = module(blocks_per_sm=3), module()
    assert "nvvm.minctasm = 3" in capped
    assert "minctasm" not in plain
