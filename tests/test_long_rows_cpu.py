"""CPU tests of the long-row machinery: rows split over a thread block cluster, backward
partials in shared memory, and LayerNorm's one-pass (count, mean, M2) merge.

GPU correctness of the same kernels is in the *_gpu.py tests (N = 12288 and 65536 run split
over clusters on Hopper); here the launch shapes, the PTX and the merge arithmetic.
"""

from __future__ import annotations

import functools
import random
import re
import statistics
from types import SimpleNamespace

import pytest

pytest.importorskip("mlir")  # the kernel modules import MLIR (the GPU machine runs without)

from kbuild import compiler  # noqa: E402
from kbuild.kernels.norms.forward import merge_moments  # noqa: E402
from kbuild.kernels.norms.layernorm import layernorm_bwd_spec, layernorm_fwd_spec  # noqa: E402
from kbuild.kernels.norms.rmsnorm import fused_add_rmsnorm_bwd_spec, rmsnorm_bwd_spec  # noqa: E402
from kbuild.op.launch import persistent_grid, rows_grid  # noqa: E402
from kbuild.plan.config import choose_row_config, cluster_size  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx, ptxas_path  # noqa: E402

SM90 = target_for_arch("sm_90")
SM80 = target_for_arch("sm_80")
GFX942 = target_for_arch("gfx942")
needs_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="ptxas not found")


@functools.cache
def _ptx_and_meta(spec, arch: str) -> tuple[str, dict]:
    target = target_for_arch(arch)
    kernel = compiler.build(spec, target)
    meta = dict(kernel.meta)
    return module_to_ptx(kernel.module, target).decode(), meta


# --- launch shapes -------------------------------------------------------------------------


def test_targets_know_their_cluster_limit():
    assert SM90.max_cluster == 8 and target_for_arch("sm_100").max_cluster == 8
    assert SM80.max_cluster == 1 and GFX942.max_cluster == 1
    assert SM90.cluster_attribute(1) is None
    with pytest.raises(ValueError, match="sm_80 allows clusters of at most 1"):
        SM80.cluster_attribute(2)


@pytest.mark.parametrize(
    "N, dtype, expected",
    [
        (65536, "bf16", 8),
        (16384, "bf16", 8),
        (12288, "f32", 8),
        (40, "bf16", 1),
        (65537, "bf16", 8),  # peeled: slices rounded up to whole vectors
        (65537, "f32", 8),
    ],
)
def test_cluster_size_is_the_most_blocks_that_split_rows_into_vectors(N, dtype, expected):
    """Peeled rows split over any cluster (each slice a whole number of vectors, the last
    one short); aligned rows over the most blocks that divide them into vectors."""
    assert cluster_size(N, dtype, True, 8) == expected
    assert cluster_size(N, dtype, True, 1) == 1


def test_only_rows_that_would_be_chunked_are_split_over_a_cluster():
    short = choose_row_config(8192, "bf16", 32, max_cluster=8)
    assert short.cluster == 1 and not short.chunked
    long = choose_row_config(262144, "bf16", 32, max_cluster=8)
    assert long.cluster == 8 and long.slice == 262144 // 8
    # Without clusters (sm_80, AMD) the same row is walked in chunks.
    assert choose_row_config(262144, "bf16", 32, max_cluster=1).chunked


def test_forced_cluster_must_split_rows_into_whole_vectors():
    cfg = choose_row_config(4096, "bf16", 32, cluster=2)
    assert (cfg.cluster, cfg.slice, cfg.exact) == (2, 2048, True)
    with pytest.raises(ValueError, match="cannot split rows of 4104"):
        choose_row_config(4104, "bf16", 32, cluster=8)
    # Each block's first `cluster` threads publish its sums to the cluster's blocks.
    with pytest.raises(ValueError, match="needs blocks of at least 8 threads"):
        choose_row_config(1024, "bf16", 32, cluster=8)


def test_grids_count_clusters_and_partial_rows():
    launcher = SimpleNamespace(rows_per_block=1, cluster=8, resident_clusters=33, meta={})
    assert rows_grid(launcher, 5) == 40
    assert persistent_grid(launcher, 1024) == (33 * 8, 33)  # one workspace row per cluster
    assert persistent_grid(launcher, 3) == (3 * 8, 3)  # never more clusters than row groups
    single = SimpleNamespace(rows_per_block=4, cluster=1, resident_clusters=10, meta={})
    assert rows_grid(single, 9) == 3
    assert persistent_grid(single, 100) == (10, 10)  # a block's 4 rows add up first
    # A persistent forward kernel gets the persistent grid (and no workspace).
    single.meta["grid"] = "persistent"
    assert rows_grid(single, 100) == 10
    assert rows_grid(single, 9) == 3


# --- generated code ------------------------------------------------------------------------


@needs_ptxas
@pytest.mark.parametrize(
    "spec",
    [
        rmsnorm_bwd_spec(65536, "bf16", "bf16", True),
        fused_add_rmsnorm_bwd_spec(65536, "bf16", "bf16", "bf16", True, True),
        layernorm_bwd_spec(65536, "bf16", "bf16", True, True),
        layernorm_bwd_spec(16384, "bf16", "bf16", True, True),
    ],
    ids=lambda s: f"{s.kernel}-{s['N']}",
)
def test_long_backward_rows_split_over_a_cluster_on_sm90(spec):
    ptx, meta = _ptx_and_meta(spec, "sm_90")
    # LayerNorm's 16384 over two 512-thread blocks (staged rows), the others over eight.
    blocks = 2 if spec.kernel == "layernorm_bwd" and spec["N"] == 16384 else 8
    assert meta["cluster"] == blocks
    assert f".reqnctapercluster {blocks}, 1, 1" in ptx
    # Row sums into the peers' shared memory: plain stores and a cluster barrier, or st.async
    # counted by mbarriers (the chooser's pick per kernel: test_cluster_sync_cpu.py).
    assert "mapa.shared::cluster" in ptx
    assert "st.shared::cluster" in ptx or "st.async.shared::cluster" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    # Partials or staged rows in shared memory, 16 bytes at a time; the row itself is read
    # once: one 128-bit load per vector of x and of dy, nothing re-read in a second pass.
    assert re.search(r"\bld\.shared\.v4\.(?:b32|f32)\b", ptx)
    cfg_iters = len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.b32\b", ptx))
    assert cfg_iters <= 3 * 2 * 2 + 2  # x, dy, w (+ dresidual) of two vectors, prefetch off
    artifact = compiler.compile_kernel(spec, SM90)
    # Two blocks an SM (64 registers), but RMSNorm's lagged rows: one block, dw partials in
    # registers (plans.plan_backward).
    registers = 128 if spec.kernel == "rmsnorm_bwd" else 64
    assert artifact.meta["spill_stores"] == 0 and artifact.meta["registers"] <= registers


@pytest.mark.parametrize(
    "spec",
    [
        layernorm_bwd_spec(65536, "bf16", "bf16", True, True),
        layernorm_fwd_spec(65536, "bf16", "bf16", "bf16", True, 1e-5),
    ],
    ids=lambda s: s.kernel,
)
def test_no_block_writes_into_a_peer_before_the_whole_cluster_runs(spec):
    """Distributed shared memory is valid once every block of the cluster has started: an
    arrive at entry, a wait before the first remote store; arrives and waits pair up."""
    ptx, _ = _ptx_and_meta(spec, "sm_90")
    events = re.findall(r"barrier\.cluster\.(arrive|wait)|(st(?:\.async)?\.shared::cluster)", ptx)
    kinds = [a or "store" for a, b in events]
    assert kinds[0] == "arrive" and kinds.index("wait") < kinds.index("store")
    assert kinds.count("arrive") == kinds.count("wait")


def test_without_clusters_the_long_backward_row_is_chunked():
    spec = layernorm_bwd_spec(65536, "bf16", "bf16", True, True)
    ptx, meta = _ptx_and_meta(spec, "sm_80")
    assert meta["cluster"] == 1
    assert "cluster" not in ptx
    assert "dynamic_shared_bytes" not in meta  # partials in the global workspace


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90", "sm_120", "gfx942", "gfx950"])
@pytest.mark.parametrize("N", [4096, 16384, 65536])
def test_shared_memory_fits_the_target(arch, N):
    """Static + dynamic shared memory never exceeds what one block may use on the target
    (99 KB on sm_86/sm_120, 64 KB of LDS on gfx942): a launch would fail otherwise."""
    target = target_for_arch(arch)
    for spec in (
        layernorm_bwd_spec(N, "bf16", "bf16", True, True),
        fused_add_rmsnorm_bwd_spec(N, "bf16", "bf16", "bf16", True, True),
        fused_add_rmsnorm_bwd_spec(N, "f32", "f32", "f32", True, True),
    ):
        kernel = compiler.build(spec, target)
        used = kernel.shared_bytes + kernel.meta.get("dynamic_shared_bytes", 0)
        assert used <= target.shared_bytes_per_block, (spec.short(), used)


def test_shared_partials_past_48_kb_are_dynamic():
    """LayerNorm N = 65536: dw and db partials of an 8192-element slice (64 KB) are declared
    extern and sized by the kernel's meta, which the launcher passes."""
    spec = layernorm_bwd_spec(65536, "bf16", "bf16", True, True)
    ptx, meta = _ptx_and_meta(spec, "sm_90")
    cfg_slice = 65536 // 8
    assert meta["dynamic_shared_bytes"] == 2 * cfg_slice * 4  # dw and db, fp32
    assert re.search(r"\.extern \.shared \.align 16 \.b8 __dynamic_smem\[\]", ptx)


def test_layernorm_forward_takes_one_row_reduction():
    """The (count, mean, M2) merge: one barrier where mean-then-variance took two."""
    ptx, _ = _ptx_and_meta(layernorm_fwd_spec(4096, "bf16", "bf16", "bf16", True, 1e-5), "sm_90")
    assert len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)) == 1
    # Counts are uniform for exact rows: folded at build time, no division left in the merge.
    assert not re.search(r"\b(?:div|rcp)\.(?:rn|full|approx)\.f32\b", ptx)


def test_layernorm_forward_predicated_rows_carry_counts():
    ptx, _ = _ptx_and_meta(layernorm_fwd_spec(1000, "f32", None, None, True, 1e-5), "sm_90")
    # Counts differ per thread: merged as values, with a reciprocal.
    assert re.search(r"\b(?:div|rcp)\.rn\.f32\b", ptx)


# --- the (count, mean, M2) merge, in plain Python floats -------------------------------------


def _state(xs: list[float]) -> list[float]:
    mean = sum(xs) / len(xs)
    return [float(len(xs)), mean, sum((x - mean) ** 2 for x in xs)]


@pytest.mark.parametrize("offset", [0.0, 1000.0, -3e4])
def test_merge_moments_gives_the_rows_mean_and_centred_sum_of_squares(offset):
    rng = random.Random(7)
    xs = [offset + rng.gauss(0, 1) for _ in range(777)]
    # Uneven pieces, merged as a tree the way lanes and warps are.
    cuts = [0, 1, 64, 65, 300, 512, 777]
    states = [_state(xs[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    while len(states) > 1:
        merged = [merge_moments(a, b) for a, b in zip(states[::2], states[1::2], strict=False)]
        states = merged + ([states[-1]] if len(states) % 2 else [])
    n, mean, m2 = states[0]
    assert n == len(xs)
    assert mean == pytest.approx(statistics.fmean(xs), rel=1e-12)
    assert m2 / n == pytest.approx(statistics.pvariance(xs), rel=1e-9)


def test_merge_moments_is_symmetric_and_ignores_empty_states():
    a, b = _state([1.0, 2.0, 4.0]), _state([10.0, -3.0])
    assert merge_moments(a, b) == merge_moments(b, a)  # every lane of a butterfly agrees
    empty = [0.0, 0.0, 0.0]
    assert merge_moments(a, empty) == pytest.approx(a, rel=1e-15)
    assert merge_moments(empty, empty) == empty  # no 0 / 0: threads wholly past the row
