"""Reductions with any merge: a maximum, an online softmax's (max, sum) pair and an argmax,
their values on the CPU (MLIR's ExecutionEngine, as test_dsl_math_cpu.py does for fma), and
the same merges through warp shuffles, a block's shared memory and a cluster's exchange,
lowered for sm_90 and gfx942.

A butterfly reduction merges (a, b) in one lane and (b, a) in its partner: a merge that is
not symmetric bit for bit leaves lanes with different results, so symmetry is checked on
every input, not assumed."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlir")

from mlir import ir  # noqa: E402
from mlir.dialects import arith, vector  # noqa: E402

from kbuild.dsl import (  # noqa: E402
    NEG_INF,
    Kernel,
    RowTile,
    V,
    first_largest,
    largest,
    softmax_pair,
    thread_max,
    thread_sum,
    widen,
)
from kbuild.plan.config import choose_row_config  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx  # noqa: E402

from .test_dsl_math_cpu import _jit  # noqa: E402

W = 8  # lanes per operand
rng = np.random.default_rng(0)


def _part(v: V, index: int, width: int = W) -> V:
    lanes = list(range(index * width, (index + 1) * width))
    return V(vector.shuffle(v.value, v.value, lanes))


def _concat(parts: list[V]) -> V:
    joined = parts[0]
    for p in parts[1:]:
        joined = V(vector.shuffle(joined.value, p.value, list(range(joined.width + W))))
    return joined


def _merge_fn(merge, k: int):
    """f(in: 2k operands of W lanes) -> the merge of state a (first k) with b (last k)."""

    def body(v: V) -> V:
        state = [_part(v, i) for i in range(2 * k)]
        return _concat(merge(state[:k], state[k:]))

    return _jit("f32", 2 * k * W, k * W, body)


def _call(fn, *operands: np.ndarray) -> list[np.ndarray]:
    out = fn(np.concatenate([np.asarray(o, np.float32) for o in operands]))
    return [out[i * W : (i + 1) * W] for i in range(len(out) // W)]


def test_largest_is_the_maximum_and_keeps_a_nan():
    fn = _merge_fn(largest, 1)
    a = np.array([1, -np.inf, np.nan, 0.0, -0.0, 3, -5, np.inf], np.float32)
    b = np.array([2, -np.inf, 1.0, -0.0, 0.0, 3, -6, 1.0], np.float32)
    (ab,), (ba,) = _call(fn, a, b), _call(fn, b, a)
    np.testing.assert_array_equal(ab, np.maximum(a, b))  # NaN propagates, as torch.amax's
    assert ab.tobytes() == ba.tobytes()


def _softmax_state(x: np.ndarray) -> tuple[float, float]:
    m = float(np.max(x)) if len(x) else -np.inf
    return m, float(np.exp(x.astype(np.float64) - m).sum()) if len(x) else 0.0


def test_softmax_pair_merges_two_halves_of_a_row():
    fn = _merge_fn(softmax_pair, 2)
    halves = [(rng.normal(0, 3, 40), rng.normal(5, 1, 7)) for _ in range(W - 2)]
    halves += [(np.array([]), rng.normal(0, 1, 5)), (np.array([]), np.array([]))]  # padding
    states = [
        (_softmax_state(a), _softmax_state(b), _softmax_state(np.r_[a, b])) for a, b in halves
    ]
    ma, sa = (np.array([s[0][i] for s in states], np.float32) for i in (0, 1))
    mb, sb = (np.array([s[1][i] for s in states], np.float32) for i in (0, 1))
    m, s = _call(fn, ma, sa, mb, sb)
    m_ba, s_ba = _call(fn, mb, sb, ma, sa)
    assert m.tobytes() == m_ba.tobytes() and s.tobytes() == s_ba.tobytes()  # symmetric
    want_m = np.array([t[2][0] for t in states], np.float32)
    want_s = np.array([t[2][1] for t in states])
    np.testing.assert_array_equal(m, want_m)
    # Both sides only padding: (-inf, 0), not NaN (exp(-inf - -inf) unguarded is NaN).
    assert m[-1] == -np.inf and s[-1] == 0.0
    np.testing.assert_allclose(s, want_s, rtol=3e-6)


def test_first_largest_takes_the_first_of_equal_maxima():
    fn = _merge_fn(first_largest, 2)
    va = np.array([1, 5, 5, -np.inf, 2, 7, 0, 3], np.float32)
    ia = np.array([0, 9, 3, 1, 4, 2, 8, 6], np.float32)
    vb = np.array([2, 5, 5, -np.inf, 1, 7, 0, 3], np.float32)
    ib = np.array([5, 2, 7, 0, 6, 11, 3, 1], np.float32)
    v, i = _call(fn, va, ia, vb, ib)
    v2, i2 = _call(fn, vb, ib, va, ia)
    assert v.tobytes() == v2.tobytes() and i.tobytes() == i2.tobytes()
    np.testing.assert_array_equal(v, np.maximum(va, vb))
    np.testing.assert_array_equal(i, [5, 2, 3, 0, 4, 2, 3, 1])


def test_first_largest_lets_a_nan_win_as_torch_argmax_does():
    # Without the NaN rule, merge(1, NaN) keeps 1 and merge(NaN, 1) keeps NaN: the lanes of a
    # butterfly end with different answers, and the NaN torch.argmax reports is lost.
    fn = _merge_fn(first_largest, 2)
    nan = np.nan
    va = np.array([1, nan, nan, nan, 2, -np.inf, 0, nan], np.float32)
    ia = np.array([0, 4, 9, 2, 1, 3, 5, 7], np.float32)
    vb = np.array([nan, 1, nan, nan, 2, nan, 0, 5], np.float32)
    ib = np.array([8, 1, 3, 6, 0, 2, 4, 1], np.float32)
    v, i = _call(fn, va, ia, vb, ib)
    v_ba, i_ba = _call(fn, vb, ib, va, ia)
    assert v.tobytes() == v_ba.tobytes() and i.tobytes() == i_ba.tobytes()
    assert np.isnan(v[[0, 1, 2, 3, 5, 7]]).all()
    np.testing.assert_array_equal(i, [8, 4, 3, 2, 0, 2, 4, 7])


def test_thread_sum_and_max_cover_every_lane_of_every_vector():
    total = _jit("f32", 3 * W, 1, lambda v: thread_sum([_part(v, i) for i in range(3)]))
    top = _jit("f32", 3 * W, 1, lambda v: thread_max([_part(v, i) for i in range(3)]))
    x = rng.normal(size=3 * W).astype(np.float32)
    x[17] = 40.0  # in the last vector, not its first lane
    np.testing.assert_allclose(total(x)[0], x.astype(np.float64).sum(), rtol=1e-6)
    assert top(x)[0] == 40.0


def _row_kernel(target, N: int, threads: int, cluster: int):
    """A kernel whose rows reduce a max, an online softmax pair and an argmax over `threads`
    threads (more than a warp: shuffles, then shared memory) and `cluster` blocks."""
    cfg = choose_row_config(
        N, "bf16", target.warp_size, threads_per_row=threads, max_cluster=cluster, cluster=cluster
    )
    with Kernel("merges", target, cfg.block, cluster=cfg.cluster) as k:
        x, out, M = k.ptr("x"), k.ptr("out"), k.i64("M")
        t = RowTile(k, cfg, M)
        v = widen(t.load(x, "bf16", pad=NEG_INF))
        (m,) = t.reduce([thread_max(v)], largest)
        pair = t.reduce([m, thread_sum(v)], softmax_pair)
        lane = V(arith.sitofp(ir.F32Type.get(), t.lane.value))
        best = t.reduce([thread_max(v), lane], first_largest)
        t.store_row_scalar(out, pair[1] + best[1])
    return k, cfg


@pytest.mark.parametrize(
    "arch, cluster", [("sm_90", 1), ("sm_90", 2), ("gfx942", 1)], ids=["sm_90", "cluster", "gfx942"]
)
def test_merges_lower_through_warp_block_and_cluster(arch, cluster):
    target = target_for_arch(arch)
    k, cfg = _row_kernel(target, 8192, 256, cluster)
    assert cfg.threads_per_row > target.warp_size and cfg.cluster == cluster
    with k.context:
        assert k.module.operation.verify()
    if target.vendor == "nvidia":
        ptx = module_to_ptx(k.module, target).decode()
        assert "shfl.sync.bfly" in ptx and "max.NaN.f32" in ptx and "ex2.approx" in ptx
        assert ("mapa" in ptx or "st.async" in ptx or "barrier.cluster" in ptx) == (cluster > 1)
    else:
        pytest.importorskip("llvmlite")
        from kbuild.compiler import _lowered
        from kbuild.spec import KernelSpec

        assert "rocdl" in _lowered(k, KernelSpec.make("merges", N=8192), target)
