"""Dependent launch (Hopper and later): a kernel is launched before the one ahead of it in its
stream has finished, so it must wait for that kernel before touching memory.

The runtime launches a kernel early only when its artifact says it was built for it (meta
"dependent_launch"); then its first instruction past the parameter loads must be
griddepcontrol.wait. A load of global memory above the wait would read what the previous
kernel has not written yet (a weight an optimizer kernel just updated, dy the next norm's
backward just wrote): wrong numbers only now and then, which no GPU test catches reliably,
so the PTX of one kernel of every kind in the manifests is read here.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from kbuild import env
from kbuild.manifest import manifest
from kbuild.targets import target_for_arch

pytest.importorskip("mlir")

from kbuild.compiler import build  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx  # noqa: E402


def _one_of_each_kernel():
    seen = {}
    for name in ("tests", "bench"):
        for spec in manifest(name):
            seen.setdefault(spec.kernel, spec)
    return [seen[k] for k in sorted(seen)]


SPECS = _one_of_each_kernel()
# Before the wait: the entry's declarations, parameter loads and special-register reads only.
_DECLARATION = re.compile(r"^(\.reg|\.shared|\.local|//|\{|$)")
_HARMLESS = re.compile(r"^(ld\.param|mov\.u32\s+%r\d+, %(tid|ctaid|ntid|nctaid|cluster_ctarank))")


def test_every_kernel_kind_is_covered():
    """The manifests hold every kind the ops launch (a new kind must be read below too)."""
    kinds = {s.kernel for s in SPECS}
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "column_sum"} <= kinds
    assert {"fused_add_rmsnorm_fwd", "fused_add_rmsnorm_bwd", "bias_grad", "encoder_fwd"} <= kinds


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kernel)
def test_hopper_kernels_wait_for_their_predecessor_first(spec):
    target = target_for_arch("sm_90")
    kernel = build(spec, target)
    assert kernel.meta.get("dependent_launch") is True
    lines = [line.strip() for line in module_to_ptx(kernel.module, target).decode().splitlines()]
    body = lines.index("{", next(i for i, line in enumerate(lines) if ".entry" in line))
    wait = lines.index("griddepcontrol.wait;")
    assert lines.count("griddepcontrol.wait;") == 1
    assert lines[wait + 1] == "griddepcontrol.launch_dependents;"
    before = [line for line in lines[body:wait] if not _DECLARATION.match(line)]
    assert all(_HARMLESS.match(line) for line in before), before


@pytest.mark.parametrize("arch", ["sm_80", "gfx942"])
def test_older_and_amd_targets_build_no_wait(arch):
    """Without the hardware for it the kernel carries no wait and the runtime launches it
    plainly (the meta flag is what the runtime reads)."""
    spec = next(s for s in SPECS if s.kernel == "layernorm_bwd")
    kernel = build(spec, target_for_arch(arch))
    assert "dependent_launch" not in kernel.meta
    assert "griddepcontrol" not in str(kernel.module)


def test_the_launch_structs_match_cuda_h():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out
    (the C++ hot path static_asserts the same sizes): a wrong offset would launch with a
    garbage stream or attribute."""
    from kbuild.runtime.cuda import _LaunchAttribute, _LaunchConfig

    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.shared.offset, _LaunchConfig.stream.offset) == (24, 32)
    assert (_LaunchConfig.attrs.offset, _LaunchConfig.count.offset) == (40, 48)


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv("KBUILD_DEPENDENT_LAUNCH", raising=False)
    assert env.dependent_launch()
    monkeypatch.setenv("KBUILD_DEPENDENT_LAUNCH", "0")
    assert not env.dependent_launch()
