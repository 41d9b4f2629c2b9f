"""The loss and transformer-block ops' kernels as AMD code objects, built on a CPU: each
compiles to a loadable HSACO (code object v5, wave64) for MI300X (gfx942) and MI355X
(gfx950), with its launch metadata, as the norms' do (tests/test_amd_cpu.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("llvmlite")

ARCHES = ("gfx942", "gfx950")


def _specs() -> dict:
    import torch

    from kbuild.kernels.activations import kernels as act
    from kbuild.kernels.loss import kernels as ce
    from kbuild.kernels.rope import op as rope
    from kbuild.kernels.rope import qk_norm as qk_norm_rope
    from kbuild.kernels.softmax import kernels as sm

    q, k, cos, sin = rope.case_tensors((1, 8, 32, 8, 128, 128, torch.bfloat16, torch.bfloat16,
                                        False, 1, True), "meta")  # fmt: skip
    specs = {
        "cross_entropy_fwd": ce.build_cross_entropy_fwd.spec(
            N=128256, dtype="bf16", index_dtype="i64", smoothing=True, z_loss=True, softcap=True
        ),
        "cross_entropy_fwd 50257": ce.build_cross_entropy_fwd.spec(
            N=50257, dtype="bf16", index_dtype="i32"
        ),
        "cross_entropy_rescale": ce.build_cross_entropy_rescale.spec(N=128256, dtype="bf16"),
        "softmax_fwd": sm.build_softmax_fwd.spec(N=32768, dtype="bf16"),
        "swiglu_fwd": act.build_swiglu_fwd.spec(N=14336, dtype="bf16"),
        "geglu_fused_bwd": act.build_geglu_fused_bwd.spec(N=9216, dtype="bf16", tanh=True),
        "gelu_bwd": act.build_gelu_bwd.spec(N=3072, dtype="bf16", tanh=True),
    }
    fwd, bwd = rope.specs_for(q, k, cos, sin)
    specs["rope"], specs["rope backward"] = fwd, bwd
    weight = torch.empty(128, dtype=torch.bfloat16, device="meta")
    for i, spec in enumerate(qk_norm_rope.specs_for(q, k, weight, weight, cos, sin)):
        specs[f"qk_norm_rope {i}"] = spec
    return specs


@pytest.fixture(scope="module")
def specs():
    return _specs()


@pytest.mark.parametrize("arch", ARCHES)
def test_every_op_kernel_is_a_code_object(specs, arch):
    from kbuild import compiler
    from kbuild.targets import amd, target_for_arch

    target = target_for_arch(arch)
    for name, spec in specs.items():
        art = compiler.compile_kernel(spec, target)
        facts = amd.read_code_object(art.binary)
        assert art.format == "hsaco", name
        assert facts["osabi"] == 64 and facts["abi_version"] == 3, name  # HSA, v5
        assert facts["e_flags"] & 0xFF == amd.MACH[arch], name
        assert f"{art.entry}.kd" in facts["symbols"], name
        assert art.meta["wavefront_size"] == 64, name
        assert art.meta["max_flat_workgroup_size"] == art.meta["block"], name
