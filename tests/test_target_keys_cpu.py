"""Targets that differ only in their arch (sm_90 and sm_90a: the same PTX ISA, features and
pass pipeline) are different disk entries: a cubin built for sm_90a runs only on sm_90
devices and uses instructions (wgmma, setmaxnreg) an sm_90 build does not, so one must never
be served for the other. Their key differs by the arch alone, so these tests hold that one
field to account."""

from __future__ import annotations

from pathlib import Path

import pytest

from kbuild.artifact import Artifact
from kbuild.cache import DiskCache, entry_key, toolchain_key
from kbuild.cache.prune import Entry, is_stale
from kbuild.spec import KernelSpec
from kbuild.targets import _NVIDIA_PTX, target_for_arch

# Every arch-specific NVIDIA target with its portable twin: (sm_90, sm_90a), (sm_100, sm_100a).
TWINS = [(arch[:-1], arch) for arch in _NVIDIA_PTX if arch.endswith("a")]
TOOLS = {"mlir": "22.1.8.4", "ptxas": "13.0.88"}
TOOLCHAIN = toolchain_key(TOOLS)


def _spec() -> KernelSpec:
    return KernelSpec.make("rmsnorm_fwd", N=4096, dtype="bf16", eps=1e-6, store_rstd=True)


def test_the_twins_are_there():
    assert ("sm_90", "sm_90a") in TWINS and len(TWINS) >= 2


@pytest.mark.parametrize("plain, specific", TWINS)
def test_an_arch_suffix_changes_the_disk_key(plain, specific):
    """Catches a key built from the target's other fields (features, warp size, pipeline),
    which the twins share: sm_90a's cubin would be the entry an sm_90 lookup finds."""
    a, b = target_for_arch(plain), target_for_arch(specific)
    fields_a, fields_b = a.key_fields(), b.key_fields()
    assert {k for k in fields_a if fields_a[k] != fields_b[k]} == {"arch"}  # the twins' case
    assert entry_key(_spec(), a) != entry_key(_spec(), b)


@pytest.mark.parametrize("plain, specific", TWINS)
def test_a_build_for_one_twin_is_a_miss_for_the_other(tmp_path, plain, specific):
    """Through the disk cache, by the exact toolchain and by entry key alone (the offline
    machine's lookup: it takes the newest toolchain's entry, so a shared entry key would hand
    it the other arch's binary)."""
    cache = DiskCache(tmp_path)
    built = Artifact(b"\x7fELF" + bytes(64), "cubin", "rmsnorm_fwd_kernel", {"block": [256, 1, 1]})
    cache.put(entry_key(_spec(), target_for_arch(specific)), TOOLCHAIN, built, TOOLS)
    other = entry_key(_spec(), target_for_arch(plain))
    assert cache.get(other, TOOLCHAIN) is None and cache.get(other, None) is None
    assert cache.get(entry_key(_spec(), target_for_arch(specific)), TOOLCHAIN) is not None


@pytest.mark.parametrize("arch", [a for pair in TWINS for a in pair])
def test_prune_reads_each_twins_entry_back_as_current(arch):
    """`kbuild cache prune --stale` rebuilds each entry's key from its meta (the spec and the
    target's arch): an arch written without its suffix would find sm_90a's entries stale and
    delete every one of them."""
    spec, target = _spec(), target_for_arch(arch)
    key = entry_key(spec, target)
    meta = {"meta": {"spec": spec.to_json(), "target": target.arch}}  # as compiler.py writes
    assert not is_stale(Entry(Path("/nowhere") / key / TOOLCHAIN, meta, 0, 0.0))
