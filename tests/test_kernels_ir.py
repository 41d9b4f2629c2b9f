"""CPU tests of kernel code generation: IR verifies, lowers for NVIDIA and AMD, and the PTX
and cubins have the shape the design asks for (128-bit accesses, no spills).

Compiles are shared through functools.cache: building is ~10 ms, a cubin ~50-600 ms.
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest

from kbuild import compiler
from kbuild.artifact import Artifact
from kbuild.cli.manifest import manifest
from kbuild.cli.widths import column_sum_spec
from kbuild.kernels.norms.rmsnorm import (
    fused_add_rmsnorm_bwd_spec,
    rmsnorm_bwd_spec,
    rmsnorm_fwd_spec,
)
from kbuild.plan.config import choose_row_config
from kbuild.spec import KernelSpec
from kbuild.targets import target_for_arch
from kbuild.targets.nvidia import module_to_ptx, ptxas_path

SM90 = target_for_arch("sm_90")
SM80 = target_for_arch("sm_80")
GFX942 = target_for_arch("gfx942")

needs_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="ptxas not found")


def _weight(dtype: str, kind: str | None) -> str | None:
    return dtype if kind == "same" else kind


def _build_matrix() -> list[KernelSpec]:
    specs = []
    for n, dtype, weight, store_rstd in itertools.product(
        (1, 7, 127, 1000, 4096, 65536, 200000),
        ("f32", "f16", "bf16"),
        ("same", "f32", None),
        (False, True),
    ):
        specs.append(rmsnorm_fwd_spec(n, dtype, _weight(dtype, weight), store_rstd, 1e-6))
    return list(dict.fromkeys(specs))  # weight "same" and "f32" coincide for f32


def _id(spec: KernelSpec) -> str:
    return "-".join(f"{k}={v}" for k, v in spec.params if k != "eps")


@functools.cache
def ptx_of(spec: KernelSpec, arch: str) -> str:
    """PTX for a freshly built kernel (the pipeline rewrites the module in place)."""
    target = target_for_arch(arch)
    return module_to_ptx(compiler.build(spec, target).module, target).decode()


@functools.cache
def cubin_of(spec: KernelSpec, arch: str) -> Artifact:
    return compiler.compile_kernel(spec, target_for_arch(arch))


BF16_4096 = rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6)
BF16_4096_UNALIGNED = rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6, vectorize=False)
BF16_65536 = rmsnorm_fwd_spec(65536, "bf16", "bf16", False, 1e-6)
F32_4096 = rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-6)


# --- build + verify -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", _build_matrix(), ids=_id)
def test_build_verifies_for_sm90(spec):
    kernel = compiler.build(spec, SM90)
    expected = ["x"] + (["weight"] if spec["weight_dtype"] else []) + ["y"]
    expected += (["rstd"] if spec["store_rstd"] else []) + ["M"]
    assert [name for name, _ in kernel.signature()] == expected
    assert kernel.signature()[-1] == ("M", "i64")
    assert 1 <= kernel.block <= 1024
    assert kernel.block % kernel.meta["rows_per_block"] == 0


def test_unaligned_spec_turns_vectorizing_off():
    assert BF16_4096["vectorize"] is True
    assert BF16_4096_UNALIGNED["vectorize"] is False
    # N not a multiple of the 16-byte vector: still vectors, the rows peeled (dsl.rows).
    assert rmsnorm_fwd_spec(1000, "bf16", None, False, 1e-6)["vectorize"] is True
    assert rmsnorm_fwd_spec(1001, "bf16", None, False, 1e-6)["vectorize"] is True


# --- AMD: everything lowers through ROCDL -------------------------------------------------


def _amd_specs() -> list[KernelSpec]:
    """The standard set, plus each tests-manifest spec that brings a kernel a parameter value
    not yet covered (every N, dtype, weight dtype and flag of every kernel appears once)."""
    picked, seen = list(manifest("standard")), set()
    for spec in manifest("tests"):
        features = {(spec.kernel, name, value) for name, value in spec.params}
        if not features <= seen:
            seen |= features
            picked.append(spec)
    return list(dict.fromkeys(picked))


@pytest.mark.parametrize("spec", _amd_specs(), ids=_id)
def test_lowers_through_rocdl_for_gfx942(spec):
    text = compiler.lower(spec, GFX942)
    assert "rocdl." in text
    assert "nvvm." not in text
    assert "gpu.func" not in text  # the kernel became an llvm.func


def test_amd_subset_covers_every_parameter_value():
    specs, tests = _amd_specs(), manifest("tests")

    def values(specs: list[KernelSpec]) -> set[tuple]:
        return {(s.kernel, name, value) for s in specs for name, value in s.params}

    assert set(manifest("standard")) <= set(specs)
    assert values(specs) >= values(tests)
    assert ("rmsnorm_fwd", "vectorize", False) in values(specs)
    assert len(specs) < len(tests) // 4


@pytest.mark.parametrize("target", [SM90, GFX942], ids=str)
def test_reduction_is_sized_by_the_targets_warp(target):
    # Rows wider than a warp reduce through shared memory, one f32 slot per warp per row:
    # for 4096 bf16 (128 threads a row) that is 4 slots on NVIDIA and 2 on CDNA.
    assert target.warp_size == (64 if target.vendor == "amd" else 32)
    cfg = choose_row_config(4096, "bf16", target.warp_size)
    assert cfg.threads_per_row > target.warp_size
    kernel = compiler.build(BF16_4096, target)
    assert kernel.block == cfg.block
    warps = cfg.threads_per_row // target.warp_size
    assert kernel.shared_bytes == 4 * cfg.rows_per_block * warps


def test_lowered_nvidia_text_has_no_rocdl():
    text = compiler.lower(BF16_4096, SM90)
    assert "nvvm." in text
    assert "rocdl." not in text


# --- PTX: 128-bit accesses ----------------------------------------------------------------


def test_aligned_bf16_uses_128_bit_loads_and_stores():
    ptx = ptx_of(BF16_4096, "sm_90")
    iters = choose_row_config(4096, "bf16", SM90.warp_size).iters
    # One ld.global.v4.b32 per 8-element vector of x and of the weight; one store per vector.
    assert len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.b32\b", ptx)) == 2 * iters
    assert len(re.findall(r"\bst\.global\.v4\.b32\b", ptx)) == iters
    assert not re.search(r"\bld\.global(?:\.nc)?\.[bu]16\b", ptx), "scalar 16-bit loads of x"
    assert not re.search(r"\bst\.global\.[bu]16\b", ptx)
    assert f".maxntid {choose_row_config(4096, 'bf16', 32).block}, 1, 1" in ptx


def test_unaligned_bf16_uses_no_vector_accesses():
    ptx = ptx_of(BF16_4096_UNALIGNED, "sm_90")
    assert not re.search(r"\b(?:ld|st)\.global(?:\.nc)?\.v\d", ptx)
    assert re.search(r"\bld\.global(?:\.nc)?\.b16\b", ptx)
    assert re.search(r"\bst\.global\.b16\b", ptx)


# --- ptxas: cubins, registers, no spills --------------------------------------------------


# The RMSNorm forward at N = 65536 (one 1024-thread block a row at the 64-register cap)
# spilled 8 bytes on sm_90 and 232 on sm_80 until its second widening of the packed bf16 row
# came from 32-bit words (plans.plan_forward, word_widening).
@needs_ptxas
@pytest.mark.parametrize(
    "spec, arch",
    [
        pytest.param(spec, arch, id=name)
        for spec, arch, name in (
            (BF16_4096, "sm_90", "bf16-4096-sm90"),
            (BF16_65536, "sm_90", "bf16-65536-sm90"),
            (BF16_65536, "sm_80", "bf16-65536-sm80"),
            (F32_4096, "sm_90", "f32-4096-sm90"),
            (BF16_4096, "sm_80", "bf16-4096-sm80"),
        )
    ],
)
def test_compile_kernel_gives_a_spill_free_cubin(spec, arch):
    artifact = cubin_of(spec, arch)
    meta = artifact.meta
    assert artifact.format == "cubin"
    assert artifact.binary[:4] == b"\x7fELF"
    assert artifact.entry == "rmsnorm_fwd"
    assert meta["registers"] > 0
    assert meta["spill_stores"] == meta["spill_loads"] == 0
    assert meta["stack_bytes"] == 0
    assert meta["target"] == arch
    assert KernelSpec.from_json(meta["spec"]) == spec


@needs_ptxas
def test_compile_meta_records_launch_facts_and_timings():
    meta = cubin_of(BF16_4096, "sm_90").meta
    kernel = compiler.build(BF16_4096, SM90)
    cfg = choose_row_config(4096, "bf16", SM90.warp_size)
    assert meta["block"] == kernel.block == cfg.block
    assert meta["shared_bytes"] == kernel.shared_bytes
    assert meta["rows_per_block"] == cfg.rows_per_block
    signature = [("x", "ptr"), ("weight", "ptr"), ("y", "ptr"), ("M", "i64")]
    assert [tuple(a) for a in meta["signature"]] == signature
    times = meta["compile_ms"]
    assert set(times) == {"build", "lower", "assemble", "total"}
    assert all(t >= 0 for t in times.values())
    assert times["total"] >= max(times["build"], times["lower"], times["assemble"]) > 0


# --- errors -------------------------------------------------------------------------------


def test_unknown_arch_names_the_valid_ones():
    with pytest.raises(ValueError, match="sm_91") as info:
        target_for_arch("sm_91")
    for arch in ("sm_80", "sm_90", "gfx942"):
        assert arch in str(info.value)


def test_compile_kernel_for_amd_without_its_toolchain_is_a_clear_compile_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llvmlite(name, *args, **kwargs):
        if name.startswith("llvmlite"):
            raise ImportError("no llvmlite here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llvmlite)
    with pytest.raises(compiler.CompileError, match=r"pip install 'kbuild\[amd\]'"):
        compiler.compile_kernel(BF16_4096, GFX942)


def test_unknown_kernel_and_bad_param_are_compile_errors():
    with pytest.raises(compiler.CompileError, match="unknown kernel 'nope'"):
        compiler.build(KernelSpec.make("nope", N=1), SM90)
    bogus = KernelSpec.make("rmsnorm_fwd", **BF16_4096.kwargs, bogus=1)
    with pytest.raises(compiler.CompileError, match=r"rmsnorm_fwd\(.*sm_90.*bogus"):
        compiler.build(bogus, SM90)


@pytest.mark.parametrize(
    "params",
    [{"dtype": "f64"}, {"N": 0}, {"N": -8}],
    ids=["dtype-f64", "N-0", "N-negative"],
)
def test_invalid_params_are_compile_errors(params):
    spec = KernelSpec.make("rmsnorm_fwd", **(BF16_4096.kwargs | params))
    with pytest.raises(compiler.CompileError, match="rmsnorm_fwd"):
        compiler.build(spec, SM90)


# --- the bench manifest: every kernel a benchmark launches assembles without spills --------


def _bench_specs() -> list[KernelSpec]:
    return manifest("bench")


@needs_ptxas
@pytest.mark.parametrize("spec", _bench_specs(), ids=_id)
def test_bench_manifest_compiles_spill_free_for_sm90(spec):
    # compile_kernel builds and verifies the IR first (a CompileError otherwise).
    artifact = cubin_of(spec, "sm_90")
    meta = artifact.meta
    assert artifact.format == "cubin"
    assert artifact.binary[:4] == b"\x7fELF"
    assert meta["registers"] > 0
    assert meta["spill_stores"] == 0, f"{meta['spill_stores']} bytes of spill stores"
    assert meta["spill_loads"] == 0, f"{meta['spill_loads']} bytes of spill loads"
    assert meta["stack_bytes"] == 0
    assert KernelSpec.from_json(meta["spec"]) == spec


def test_bench_manifest_has_every_kernel_of_a_training_step():
    kernels = {spec.kernel for spec in _bench_specs()}
    assert kernels >= {
        "rmsnorm_fwd",
        "rmsnorm_bwd",
        "fused_add_rmsnorm_fwd",
        "fused_add_rmsnorm_bwd",
        "column_sum",
    }


# --- AMD: the backward kernels lower through ROCDL across N and dtype ----------------------


def _amd_backward_specs() -> list[KernelSpec]:
    """rmsnorm_bwd, fused_add_rmsnorm_bwd and column_sum for N in (7, 1000, 4096) x dtype:
    exact rows, predicated rows and unvectorised rows, with and without dw, dresidual_out
    and an fp32 residual stream; less whatever test_lowers_through_rocdl_for_gfx942 has."""
    specs = []
    for n, dtype in itertools.product((7, 1000, 4096), ("f32", "f16", "bf16")):
        specs += [
            rmsnorm_bwd_spec(n, dtype, dtype, True),
            rmsnorm_bwd_spec(n, dtype, None, False, vectorize=False),
            fused_add_rmsnorm_bwd_spec(n, dtype, "f32", "f32", True, True),
            fused_add_rmsnorm_bwd_spec(n, dtype, dtype, dtype, True, False),
            column_sum_spec(n, dtype),
        ]
    already = set(_amd_specs())
    return [s for s in dict.fromkeys(specs) if s not in already]


@pytest.mark.parametrize("spec", _amd_backward_specs(), ids=_id)
def test_backward_lowers_through_rocdl_for_gfx942(spec):
    text = compiler.lower(spec, GFX942)
    assert "rocdl." in text
    assert "nvvm." not in text
    assert "gpu.func" not in text


def test_two_plane_column_sum_takes_both_outputs_in_one_launch():
    from kbuild.kernels.reduce import build_column_sum_module  # MLIR: not on the GPU machine

    kernel = build_column_sum_module(65536, "bf16", target_for_arch("sm_90"), planes=2)
    assert [name for name, _ in kernel.signature()] == ["partial", "out", "out1", "R"]
    assert kernel.meta["planes"] == 2 and kernel.meta["columns_per_block"] == 128
    with pytest.raises(ValueError, match="planes must be 1 or 2"):
        build_column_sum_module(64, "bf16", target_for_arch("sm_90"), planes=3)


@pytest.mark.parametrize("N", [1, 7, 64, 128, 768, 1024, 2048, 4096, 8192, 16384, 65536, 262144])
def test_column_sum_lanes_read_whole_sectors_and_fill_the_device(N):
    # Each warp reads at least two 16-byte column vectors of a row (32 bytes, a whole sector:
    # 256 lanes a vector read half of each, LayerNorm N = 1024 6.2 us against 4.6 at 128), and
    # short rows, whose backwards leave ~1000 partial rows, get 128 lanes a column vector (32
    # lanes at N = 64 left 2 blocks walking 528 rows a thread: 36 us, a third of the backward).
    from kbuild.kernels.reduce import BLOCK, THREADS, build_column_sum_module, row_lanes

    lanes = row_lanes(N)
    assert lanes & (lanes - 1) == 0 and 8 <= lanes <= BLOCK // 2
    assert lanes == 128 if N <= 2048 else lanes == 8 or N // 4 * lanes <= THREADS
    kernel = build_column_sum_module(N, "bf16", target_for_arch("sm_90"))
    vec = 4 if N % 4 == 0 else 1
    assert kernel.meta["columns_per_block"] == BLOCK // lanes * vec


def test_column_sum_lanes_must_be_a_power_of_two_dividing_the_block():
    from kbuild.dsl import Kernel
    from kbuild.kernels.reduce import _sum_columns

    with Kernel("lanes", target_for_arch("sm_90"), 256) as k:
        src = k.ptr("src")
        with pytest.raises(ValueError, match="lanes must be a power of two dividing the block"):
            _sum_columns(k, src, "f32", 4, 64, 96, 0, 1, 0, lambda total, col: None)
