"""bench/bench_block.py without a GPU: it imports; its warmup_specs() holds every kbuild kernel
the script launches, recomputed here from meta tensors made as the script makes its CUDA ones
(the timed shapes and the checks' small ones), with no duplicates; a few of those kernels
build to PTX for sm_90; its fp64 check keeps the right implementations (one that writes into
its inputs and dy as Liger's do, on CPU) and drops a wrong or a raising one; and its cases
make a forward call and a replayable backward per implementation (CPU tensors)."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import bench_block as bb
from kbuild.kernels.activations import op as act
from kbuild.kernels.rope import op as rope_ops

ROOT = Path(__file__).resolve().parents[1]


def _specs(op, *args) -> list:
    return [k.spec(*values) for k, values in op.kernel_values(*args)]


def _launched() -> list:
    """Every spec the script's kbuild calls ask for, from the script's own tensor makers on
    meta: rope on the HF views (forward, and the backward of its dense gradients), the gated
    ops' dense and fused forms and GELU, each forward and backward, at the timed and the
    checks' shapes."""
    specs = []
    for batch, seq in ((bb.B, bb.T), (bb.CHECK_B, bb.CHECK_T)):
        specs += rope_ops.specs_for(*bb.rope_tensors(batch, seq, "meta"))
    for rows in (bb.TOKENS, bb.CHECK_M):
        for family, scalars in (("swiglu", ()), ("geglu", (True,))):
            dense, _, fused = act.FAMILIES[family]
            gate, up = bb.gated_tensors(rows, bb.INTERMEDIATE, False, "meta")
            specs += _specs(dense, gate, up, *scalars)
            specs += _specs(dense.backward, gate, up, gate, *scalars)
            (gate_up,) = bb.gated_tensors(rows, bb.INTERMEDIATE, True, "meta")
            specs += _specs(fused, gate_up, *scalars)
            specs += _specs(fused.backward, gate, gate_up, *scalars)  # dy: (rows, I)
        for _, N in bb.GELU_SHAPES:
            (x,) = bb.gelu_tensors(rows, N, "meta")
            specs += _specs(act.GELU, x, True) + _specs(act.GELU.backward, x, x, True)
    return specs


def test_imports_without_cuda_and_the_views_are_hf_s():
    assert bb.B * bb.T == bb.TOKENS
    q, k, cos, sin = bb.rope_tensors(bb.B, bb.T, "meta", requires_grad=True)
    assert q.shape == (bb.B, bb.HQ, bb.T, bb.D) and k.shape == (bb.B, bb.HK, bb.T, bb.D)
    # views of dense (B, T, H * D) projections: not contiguous, last dimension dense
    assert q.stride() == (bb.T * bb.HQ * bb.D, bb.D, bb.HQ * bb.D, 1)
    assert k.stride() == (bb.T * bb.HK * bb.D, bb.D, bb.HK * bb.D, 1)
    assert q._base is not None and q.requires_grad and not q.is_leaf
    assert cos.shape == sin.shape == (bb.B, bb.T, bb.D) and cos.dtype == torch.bfloat16
    names = [b.op for b in bb.benches()]
    assert names == ["rope", "swiglu", "swiglu fused", "geglu", "geglu fused", "gelu", "gelu"]


def test_warmup_specs_cover_what_the_script_launches():
    specs = bb.warmup_specs()
    assert specs and len(specs) == len(set(specs))
    launched = _launched()
    missing = [s.short() for s in launched if s not in set(specs)]
    assert not missing, missing
    # the HF views are read in place with 16-byte vectors, forward and backward
    rope = [s for s in launched if s.kernel == "rope"]
    assert {s.kwargs["inverse"] for s in rope} == {False, True}
    assert all(s.kwargs["vec"] == 8 and s.kwargs["D"] == bb.D for s in rope)
    kernels = {s.kernel for s in launched}
    for name in ("swiglu", "geglu", "swiglu_fused", "geglu_fused", "gelu"):
        assert {f"{name}_fwd", f"{name}_bwd"} <= kernels, name


def test_the_warmup_cli_reads_the_file():
    """`kbuild warmup --module bench/bench_block.py` imports the file by its path (in a fresh
    process: that import puts bench/ first on sys.path) and finds the same specs."""
    code = "from kbuild.cli import _module_specs; print(len(_module_specs('bench/bench_block.py')))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) == len(bb.warmup_specs())


def _ptx(spec) -> str:
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch
    from kbuild.targets.nvidia import module_to_ptx

    sm90 = target_for_arch("sm_90")
    return module_to_ptx(build(spec, sm90).module, sm90).decode()


@pytest.mark.parametrize("kernel", ["rope", "swiglu_fused_bwd", "gelu_fwd"])
def test_kernels_build_to_ptx(kernel):
    spec = next(s for s in bb.warmup_specs() if s.kernel == kernel)
    ptx = _ptx(spec)
    assert ".entry" in ptx
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx), "16-byte loads"


# ----------------------------------------------------------------------------- the check


class _InPlaceSwiGLU(torch.autograd.Function):
    """Liger's contract: the backward writes dgate and dup into the saved gate and up."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return (F.silu(a.float()) * b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        a32, b32, d = a.float(), b.float(), dc.float()
        s = torch.sigmoid(a32)
        a.copy_(d * b32 * s * (1 + a32 * (1 - s)))
        b.copy_(d * a32 * s)
        dc.mul_(7)  # and clobbers dy
        return a, b


def test_check_keeps_right_peers_and_drops_wrong_ones():
    bench = next(b for b in bb.benches() if b.op == "swiglu")

    def raising(gate, up):
        raise RuntimeError("no kernel")

    impls = {
        "kbuild": bb.gated_impls("swiglu")["kbuild"],
        "torch": bb.torch_swiglu,
        "in place": lambda *x: _InPlaceSwiGLU.apply(*bb._pair(x)),
        "wrong": lambda g, u: F.silu(g) * u * 1.1,
        "raising": raising,
    }
    errors, kept = bb.check(bench, impls, "cpu")
    assert sorted(kept) == ["in place", "kbuild", "torch"]
    assert errors["wrong"] > bb.TOL and errors["raising"].startswith("RuntimeError")


def test_check_of_the_rope_views_and_the_fused_gate_up():
    for op in ("rope", "geglu fused"):
        bench = next(b for b in bb.benches() if b.op == op)
        impls = bench.impls()
        impls.pop("torch.compile")
        impls.pop("liger", None)
        errors, kept = bb.check(bench, impls, "cpu")
        assert sorted(kept) == ["kbuild", "torch"], errors


def test_cases_build_a_forward_and_a_backward_call_per_implementation():
    """cases() on CPU tensors of the checks' size: each implementation's forward call and
    its replayable backward (retain_graph: twice), and a failing one recorded, not raised."""
    from dataclasses import replace

    for op in ("rope", "swiglu fused"):
        bench = next(b for b in bb.benches() if b.op == op)
        bench = replace(bench, make=partial(bench.small, "cpu"))
        impls = {"kbuild": bench.impls()["kbuild"], "torch": bench.reference}
        impls["broken"] = lambda *x: 1 / 0
        fwd, bwd = bb.cases(bench, impls)
        # the forward is called first when timed (run_cases records its error then); the
        # backward's graph is made here
        assert sorted(bwd.impls) == ["kbuild", "torch"] and "broken" in fwd.impls
        assert bwd.results["broken"]["error"].startswith("ZeroDivisionError")
        assert bwd.nbytes > fwd.nbytes or op == "rope"
        for name in ("kbuild", "torch"):
            fwd.impls[name]()
            first, second = bwd.impls[name](), bwd.impls[name]()
            assert len(first) == bench.n_grad
            for a, b in zip(first, second, strict=True):
                assert torch.equal(a, b)
