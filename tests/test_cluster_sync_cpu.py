"""CPU tests of the ways a cluster's blocks exchange row sums (dsl.exchange): a cluster
barrier per row, or `st.async` stores counted against an mbarrier in each block, waited for
in the same row or (lagged) a row later.

Whether the mbarrier exchange computes the same rows is checked on the GPU (the tune sweep's
error column and bench/repeat_check.py while it is an option); here the PTX protocol each
form emits and the errors for options that cannot apply.
"""

from __future__ import annotations

import functools
import re

import pytest

pytest.importorskip("mlir")  # the kernel modules import MLIR

from kbuild import compiler  # noqa: E402
from kbuild.compiler import CompileError  # noqa: E402
from kbuild.spec import KernelSpec  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx, ptxas_path  # noqa: E402

LN_BWD = dict(dtype="bf16", weight_dtype="bf16", compute_dw=True, compute_db=True)
LN_FWD = dict(dtype="bf16", weight_dtype="bf16", bias_dtype="bf16", store_stats=True, eps=1e-5)


FUSED_BWD = dict(
    dtype="bf16",
    weight_dtype="bf16",
    residual_dtype="bf16",
    compute_dw=True,
    has_dresidual_out=True,
)


RMS_BWD = dict(dtype="bf16", weight_dtype="bf16", compute_dw=True)


def _spec(kernel: str, N: int, **kwargs) -> KernelSpec:
    bases = {"layernorm_fwd": LN_FWD, "fused_add_rmsnorm_bwd": FUSED_BWD, "rmsnorm_bwd": RMS_BWD}
    base = bases.get(kernel, LN_BWD)
    return KernelSpec.make(kernel, N=N, vectorize=True, **base, **kwargs)


@functools.cache
def _ptx(spec: KernelSpec) -> str:
    target = target_for_arch("sm_90")
    return module_to_ptx(compiler.build(spec, target).module, target).decode()


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("kernel, states", [("layernorm_bwd", 2), ("layernorm_fwd", 2)])
def test_mbarrier_exchange_sends_each_state_with_st_async(kernel, states):
    ptx = _ptx(_spec(kernel, 65536, cluster_sync="mbarrier"))
    # Two mbarriers (one per half of the buffer), initialised before the block announces
    # it has started: the only cluster barrier left is the one at kernel entry.
    assert _count(ptx, r"mbarrier\.init\.shared::cta\.b64") == 2
    init = ptx.index("fence.mbarrier_init.release.cluster")
    assert init < ptx.index("barrier.cluster.arrive.relaxed.aligned")
    assert _count(ptx, r"barrier\.cluster\.arrive") == 1
    assert _count(ptx, r"barrier\.cluster\.wait") == 1
    # Each block sends its row state (the sums; LayerNorm forward: mean and M2, the count
    # is known at build time) to every block, one 4-byte st.async per value.
    assert _count(ptx, r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32") == states
    assert _count(ptx, r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64") == 1
    assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64" in ptx
    assert "fence.proxy.async" not in ptx  # see dsl.exchange (the ordering argument)


def _loop_body(ptx: str) -> str:
    """The PTX from the first st.async (a row's send, inside the row loop) on."""
    return ptx[ptx.index("st.async") :]


def test_lagged_exchange_waits_for_the_row_before_after_sending_this_one():
    # The chooser's plain RMSNorm backward at N = 65536: one st.async per row (one sum), four
    # mbarriers (the slots cycle through quarters), buffer = phase % 4 and parity = phase // 4
    # derived in the wait. In the loop the send comes before the wait, which takes the row
    # before (a wait first would be the unlagged exchange); one more wait after the loop
    # takes the last row.
    ptx = _ptx(_spec("rmsnorm_bwd", 65536))
    assert _count(ptx, r"mbarrier\.init\.shared::cta\.b64") == 4
    assert _count(ptx, r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32") == 1
    waits = r"mbarrier\.try_wait\.parity\.acquire\.cluster\.shared::cta\.b64"
    assert _count(ptx, waits) == 2
    assert _count(_loop_body(ptx), waits) == 2  # both after the send
    assert _count(ptx, r"and\.b32 offset, %r\d+, 3;") == 2
    assert _count(ptx, r"shr\.u32 parity, %r\d+, 2;") == 2
    assert _count(ptx, r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64") == 2
    unlagged = _ptx(_spec("rmsnorm_bwd", 65536, cluster_sync="mbarrier"))
    assert _count(unlagged, r"mbarrier\.init\.shared::cta\.b64") == 2
    assert _count(unlagged, r"and\.b32 offset, %r\d+, 1;") == 1


def test_lagged_rows_receive_the_row_before_under_a_guard(monkeypatch):
    # What the PTX counts above cannot see: the loop's receive must take the phase carried
    # from the iteration before (the row sent then), not this iteration's (which would wait
    # for a row not yet sent by the slowest peer and read it as the row before's), and both
    # receives must be guarded: the row before the first was never sent, and an unguarded
    # wait would complete buffer 0's first phase with it, leaving every later wait one
    # phase behind.
    from kbuild.dsl.exchange import LaggedExchange

    calls = []
    send, receive = LaggedExchange.send, LaggedExchange.receive

    def record_send(self, state, phase, lane=None):
        calls.append(("send", phase, None))
        return send(self, state, phase, lane)

    def record_receive(self, phase, merge, sent=None):
        calls.append(("receive", phase, sent))
        return receive(self, phase, merge, sent)

    monkeypatch.setattr(LaggedExchange, "send", record_send)
    monkeypatch.setattr(LaggedExchange, "receive", record_receive)
    compiler.build(_spec("rmsnorm_bwd", 65536), target_for_arch("sm_90"))
    assert [c[0] for c in calls] == ["send", "receive", "receive"]  # loop body, epilogue
    (_, sent_phase, _), (_, loop_phase, loop_guard), (_, last_phase, last_guard) = calls
    assert loop_guard is not None and last_guard is not None
    assert loop_phase.value != sent_phase.value
    assert last_phase.value != sent_phase.value  # the loop's result, not a value inside it


def test_lagged_exchange_is_taken_in_two_calls():
    from kbuild.dsl import Kernel, const

    target = target_for_arch("sm_90")
    k = Kernel("probe", target, block=256, cluster=2, exchange="lagged")
    with k, pytest.raises(ValueError, match="taken in two calls: send, then receive"):
        k.exchange.reduce([const(1.0)], const(0, "i32"), lambda a, b: a)
    k = Kernel("probe2", target, block=256, cluster=2, exchange="mbarrier")
    with k, pytest.raises(ValueError, match="send and receive are the lagged exchange's"):
        k.exchange.lagged(1)
    # A lagged row sends every value (a receive counts on their bytes): no Python floats.
    k = Kernel("probe3", target, block=256, cluster=2, exchange="lagged")
    with k, pytest.raises(ValueError, match="sends 2 values a row"):
        k.exchange.lagged(2).send([const(1.0), 0.0], const(0, "i32"))


def test_layernorm_backward_alone_uses_fma_and_word_widening():
    # LayerNorm's backward: fma for its sums, dx and dw, and the second widening from packed
    # words (the mask of a word's high bf16); RMSNorm's and the fused add's keep separate
    # multiplies and adds (fma spilled their 1024-thread rows) and the 16-bit widening.
    ln = _ptx(_spec("layernorm_bwd", 65536))
    assert _count(ln, r"fma\.rn\.f32") >= 32 and _count(ln, r"and\.b32\s+%r\d+, %r\d+, -65536;") > 0
    for kernel in ("rmsnorm_bwd", "fused_add_rmsnorm_bwd"):
        ptx = _ptx(_spec(kernel, 65536))
        assert "fma.rn.f32" not in ptx and "-65536" not in ptx


def test_barrier_exchange_steps_the_cluster_each_row():
    ptx = _ptx(_spec("layernorm_bwd", 65536, cluster_sync="barrier"))
    assert "st.async" not in ptx and "mbarrier" not in ptx
    assert _count(ptx, r"barrier\.cluster\.arrive\.aligned") == 1  # in the row loop
    assert _count(ptx, r"barrier\.cluster\.wait\.aligned") == 2  # entry, and the row loop


def test_mbarrier_exchange_alternates_the_block_slots():
    # Without a cluster barrier nothing stops a fast warp from writing the next row's warp
    # sum while a slow one still reads this row's: the slots alternate halves instead.
    target = target_for_arch("sm_90")
    plain = compiler.build(_spec("layernorm_bwd", 65536, cluster_sync="barrier"), target)
    split = compiler.build(_spec("layernorm_bwd", 65536, cluster_sync="mbarrier"), target)
    warps = plain.block // 32
    # Block slots: two sums per warp, twice over; mbarriers: two of 8 bytes.
    assert split.shared_bytes - plain.shared_bytes == 2 * warps * 4 + 16


@pytest.mark.skipif(ptxas_path() is None, reason="ptxas not found")
@pytest.mark.parametrize("kernel", ["layernorm_bwd", "layernorm_fwd", "rmsnorm_bwd"])
def test_mbarrier_exchange_assembles(kernel):
    base = (
        dict(dtype="bf16", weight_dtype="bf16", compute_dw=True) if kernel == "rmsnorm_bwd" else {}
    )
    spec = (
        KernelSpec.make(kernel, N=65536, vectorize=True, cluster_sync="mbarrier", **base)
        if base
        else _spec(kernel, 65536, cluster_sync="mbarrier")
    )
    artifact = compiler.compile_kernel(spec, target_for_arch("sm_90"))
    assert artifact.meta["cluster"] == 8
    assert artifact.meta["spill_stores"] <= 8


@pytest.mark.parametrize(
    "kernel, N, options, arch, message",
    [
        ("layernorm_bwd", 4096, dict(cluster_sync="mbarrier"), "sm_90", "needs rows split over"),
        ("layernorm_fwd", 65536, dict(cluster_sync="fast"), "sm_90", "must be one of"),
        ("layernorm_fwd", 65536, dict(cluster_sync="lagged"), "sm_90", "is the backward's"),
        ("layernorm_bwd", 65536, dict(cluster_sync="lagged", stage=0), "sm_90", "staged rows"),
        ("layernorm_bwd", 65536, dict(cluster_sync="mbarrier"), "sm_80", "needs rows split over"),
        (
            "layernorm_fwd",
            4096,
            dict(cluster=8, cluster_sync="mbarrier"),
            "sm_90",
            "needs rows of more than 32 threads",
        ),
    ],
)
def test_cluster_sync_options_that_cannot_apply_raise(kernel, N, options, arch, message):
    with pytest.raises(CompileError, match=message):
        compiler.build(_spec(kernel, N, **options), target_for_arch(arch))


@pytest.mark.parametrize(
    "kernel, N, options, exchange",
    [
        ("layernorm_fwd", 65536, {}, "mbarrier"),  # staged, persistent
        ("layernorm_fwd", 65536, dict(persistent=False), "mbarrier"),
        ("layernorm_bwd", 16384, {}, "mbarrier"),  # 128-thread blocks
        ("layernorm_bwd", 65536, {}, "mbarrier"),  # staged rows, 512-thread blocks
        ("layernorm_bwd", 16384, dict(stage=1), "mbarrier"),
        ("fused_add_rmsnorm_bwd", 65536, {}, "barrier"),  # the fused backward's staged rows
        ("fused_add_rmsnorm_bwd", 65536, dict(stage=0), "mbarrier"),
        ("layernorm_bwd", 4096, {}, "barrier"),  # one block per row: no cluster at all
        ("rmsnorm_bwd", 65536, {}, "lagged"),  # staged, one block an SM
        ("rmsnorm_bwd", 65536, dict(cluster_sync="mbarrier"), "mbarrier"),
        # Forced: rows of 4096 over 8 blocks take 32 threads, no block barrier per row.
        ("layernorm_fwd", 4096, dict(cluster=8), "barrier"),
    ],
)
def test_the_chooser_picks_the_exchange_measured_faster(kernel, N, options, exchange):
    kernel_ = compiler.build(_spec(kernel, N, **options), target_for_arch("sm_90"))
    assert kernel_.exchange.mode == exchange
    ptx = _ptx(_spec(kernel, N, **options))
    assert ("st.async" in ptx) == (exchange in ("mbarrier", "lagged"))


# --- cluster shapes the plans no longer offer ------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        # Several rows per block of a cluster and clusters past the portable 8 lost every
        # sweep (bench/results/h200_tune_rows_per_block.json): not offered. (Rows per block
        # remain a tuning keyword for rows that one block holds.)
        (dict(rows_per_block=2, cluster=8), "rows_per_block needs rows held by one block"),
        (dict(cluster=16), "cluster must be from 1 to 8 blocks on sm_90, not 16"),
        (dict(cluster=32), "cluster must be from 1 to 8 blocks on sm_90, not 32"),
    ],
)
def test_cluster_shape_overrides_that_cannot_apply_raise(options, message):
    with pytest.raises(CompileError, match=message):
        compiler.build(_spec("layernorm_bwd", 65536, **options), target_for_arch("sm_90"))


# --- the exchange object ---------------------------------------------------------------------


def test_the_exchange_is_fixed_when_the_kernel_is_made():
    from kbuild.dsl import Kernel

    target = target_for_arch("sm_90")
    k = Kernel("probe", target, block=256, cluster=2, exchange="mbarrier")
    assert k.exchange.mode == "mbarrier"
    with pytest.raises(AttributeError):
        k.exchange = "barrier"
    with pytest.raises(AttributeError):
        k.exchange.mode = "barrier"
    assert Kernel("probe", target, block=256, cluster=2).exchange.mode == "barrier"


@pytest.mark.parametrize(
    "cluster, exchange, message",
    [
        (2, "fast", "exchange must be one of"),
        (1, "mbarrier", "with clusters"),
        (1, "lagged", "with clusters"),
    ],
)
def test_exchanges_that_cannot_apply_raise(cluster, exchange, message):
    from kbuild.dsl import Kernel

    with pytest.raises(ValueError, match=message):
        Kernel("probe", target_for_arch("sm_90"), block=256, cluster=cluster, exchange=exchange)


def test_the_exchange_mode_check_is_importable_for_launch_plans():
    # plans.cluster_exchange: pure logic over a RowConfig, no IR built; None: no cluster.
    from types import SimpleNamespace

    from kbuild.dsl.exchange import MODES
    from kbuild.plan.rows import EXCHANGES, cluster_exchange

    assert EXCHANGES == MODES  # the plans' copy of the vocabulary (plans import no MLIR)

    split = SimpleNamespace(cluster=8, threads_per_row=256)
    assert cluster_exchange(None, split, "mbarrier", 32) == "mbarrier"
    assert cluster_exchange("barrier", split, "mbarrier", 32) == "barrier"
    assert cluster_exchange(None, SimpleNamespace(cluster=1, threads_per_row=256), "x", 32) is None
    within_warp = SimpleNamespace(cluster=8, threads_per_row=32)
    assert cluster_exchange(None, within_warp, "mbarrier", 32) == "barrier"
    with pytest.raises(ValueError, match="needs rows of more than 32 threads"):
        cluster_exchange("mbarrier", within_warp, "mbarrier", 32)
