"""Memory-tier keys checked on CPU against the launch path: one key names one kernel.

The memory tier (kbuild/jit.py) maps the cheap tuple a launch builds to a loaded kernel and
never looks at the kernel's spec again: a key that leaves out a field the spec depends on gives
two kernels one launcher (the second call runs the wrong kernel on the GPU), and a key holding a
per-call value (M, a pointer) reloads on every call. A fake tier (launch_recorder.Tier) records
every request's key, device and spec. Also here: the alignment that picks vector accesses, and
the warmup command an offline miss suggests. tests/test_manifest_coverage_cpu.py checks the
manifests against the GPU tests' calls.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from kbuild import cli
from kbuild.cache import DiskCache
from kbuild.jit import KernelNotCached, artifact_for
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec
from kbuild.targets import target_for_arch

from .launch_recorder import TORCH, Tier, install, launch, layernorm, rmsnorm
from .launch_recorder import zeros as _t

KEY_ATOMS = (str, int, float, bool, type(None), torch.dtype)


@pytest.fixture
def tier(monkeypatch):
    fake = Tier()
    install(monkeypatch, fake.get_launcher, fake.loaded)
    return fake


# ------------------------------------------------------------------ keys: one key, one kernel

# "x" means x's dtype. Each variant changes one field of BASE, a field the kernel depends on.
BASE = dict(N=64, dtype="bf16", w="x", b="x", residual="x", store=True, eps=1e-6, planes=1)
BASE.update(unaligned=False, need_dw=True, need_db=True, dres=True)
VARIANTS = dict(N=(7, 128, 1000), dtype=("f16", "f32"), w=("f32", None), b=("f32", None))
VARIANTS.update(residual=("f32",), store=(False,), eps=(1e-5, 1e-2), unaligned=(True,))
VARIANTS.update(need_dw=(False,), need_db=(False,), dres=(False,), planes=(2,))


def _dtype(c, field):
    return c["dtype"] if c[field] == "x" else c[field]


def _row(c, M, off, name, field="dtype"):
    """(M, N) rows named `name` (misaligned when in `off`) of the dtype `field` of config c."""
    return _t((M, c["N"]), _dtype(c, field), name in off)


def _param(c, off, name, field):
    return None if c[field] is None else _row(c, 1, off, name, field).view(-1)


def _rmsnorm_fwd(c, M, off):
    x, w = _row(c, M, off, "x"), _param(c, off, "weight", "w")
    rmsnorm.rmsnorm_fwd(x, w, c["eps"], c["store"])


def _rmsnorm_bwd(c, M, off):
    x, dy, w = _row(c, M, off, "x"), _row(c, M, off, "dy"), _param(c, off, "weight", "w")
    rmsnorm.rmsnorm_bwd(dy, x, w, torch.zeros(M), c["need_dw"])


def _fused_fwd(c, M, off):
    x, r, w = _row(c, M, off, "x"), _row(c, M, off, "residual"), _param(c, off, "weight", "w")
    res_dtype = TORCH[_dtype(c, "residual")]
    rmsnorm.fused_add_rmsnorm_fwd(x, r, w, c["eps"], res_dtype, c["store"])


def _fused_bwd(c, M, off):
    dy, w = _row(c, M, off, "dy"), _param(c, off, "weight", "w")
    res_out = _row(c, M, off, "x", "residual")  # the kernel's x
    dres = _row(c, M, off, "dresidual_out", "residual") if c["dres"] else None
    rmsnorm.fused_add_rmsnorm_bwd(dy, dres, res_out, w, torch.zeros(M), c["need_dw"])


def _layernorm_fwd(c, M, off):
    x, w, b = _row(c, M, off, "x"), _param(c, off, "weight", "w"), _param(c, off, "bias", "b")
    layernorm.layernorm_fwd(x, w, b, c["eps"], c["store"])


def _layernorm_bwd(c, M, off):
    x, dy, w = _row(c, M, off, "x"), _row(c, M, off, "dy"), _param(c, off, "weight", "w")
    stats = torch.zeros(M), torch.zeros(M)
    layernorm.layernorm_bwd(
        dy, x, w, *stats, c["need_dw"], _param(c, off, "bias", "b"), c["need_db"]
    )


def _column_sum(c, M, off):
    partial = torch.zeros((c["planes"], M, c["N"]))
    launch.column_sum(partial, TORCH[c["dtype"]], partial.get_device(), 0)


# launch -> (driver, the fields it reads, the inputs whose address decides vectorizing)
LAUNCHES = {
    "rmsnorm_fwd": (_rmsnorm_fwd, "N dtype w store eps unaligned", "x weight"),
    "rmsnorm_bwd": (_rmsnorm_bwd, "N dtype w need_dw unaligned", "x dy weight"),
    "fused_add_rmsnorm_fwd": (
        _fused_fwd,
        "N dtype w residual store eps unaligned",
        "x residual weight",
    ),
    "fused_add_rmsnorm_bwd": (
        _fused_bwd,
        "N dtype w residual dres need_dw unaligned",
        "x dy dresidual_out weight",
    ),
    "layernorm_fwd": (_layernorm_fwd, "N dtype w b store eps unaligned", "x weight bias"),
    "layernorm_bwd": (_layernorm_bwd, "N dtype w b need_dw need_db unaligned", "x dy weight"),
    "column_sum": (_column_sum, "N dtype planes", ""),
}


def _assert_cheap(key) -> None:
    """A tuple (kernel name, values, device) of str/int/float/bool/None/torch.dtype atoms:
    hashed on every call, so no tensors, devices or specs in it."""
    assert type(key) is tuple and len(key) == 3 and type(key[1]) is tuple, key
    atoms = (key[0], *key[1], key[2])
    assert all(type(atom) in KEY_ATOMS for atom in atoms), key
    hash(key)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_key_and_spec_determine_each_other(name, tier, monkeypatch):
    """Every field that changes the kernel, on cuda:0 and cuda:1, each twice (other M, new
    tensors). Catches a field dropped from a key (two specs under one key: the wrong kernel
    runs on the GPU), a per-call value in a key (one spec under many keys: a reload per call),
    and a key without the device index at its end (one device's module launched on another)."""
    drive, fields, _ = LAUNCHES[name]
    configs = [BASE] + [{**BASE, f: v} for f in fields.split() for v in VARIANTS[f]]
    seen, kernels_of = [], []
    for device in (0, 1):
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self, device=device: device)
        for c in configs:
            for M in (1, 5):
                start = len(tier.requests)
                drive(c, M, {"x"} if c["unaligned"] else set())
                seen += [(device, *request) for request in tier.requests[start:]]
                kernels_of.append(tuple(tier.specs[start:]))
    # Each variant launches other kernels than BASE does, or it could not show a field missing.
    assert all(kernels and kernels != kernels_of[0] for kernels in kernels_of[2 : len(configs) * 2])
    spec_of, key_of = {}, {}
    for device, key, device_arg, spec in seen:
        _assert_cheap(key)
        assert type(key[-1]) is int and key[-1] == device_arg == device, (key, device_arg)
        first = spec_of.setdefault(key, spec)
        assert first == spec, f"{key} serves two kernels: {first.short()} and {spec.short()}"
        first_key = key_of.setdefault((spec, device), key)
        assert first_key == key, f"{spec.short()} on {device} under {first_key} and {key}"
    if name == "rmsnorm_fwd":  # the flat hot path looks up the key it then stores
        assert tier.looked_up == [key for _, key, _, _ in seen]


@pytest.mark.parametrize("name", sorted(n for n in LAUNCHES if LAUNCHES[n][2]))
def test_every_input_address_decides_vectorizing(name, tier):
    """128-bit accesses only when every row and parameter address is 16-byte aligned: a pointer
    left out of the alignment check would run the vector kernel on a misaligned address."""
    drive, _, pointers = LAUNCHES[name]
    drive(BASE, 3, set())
    assert tier.requests[0][2]["vectorize"] is True
    for pointer in pointers.split():
        tier.requests.clear()
        drive(BASE, 3, {pointer})
        assert tier.requests[0][2]["vectorize"] is False, f"{pointer} misaligned, still vectors"


# ------------------------------------------------------------- offline miss: the warmup command


@pytest.mark.parametrize("where", ["argument", "KBUILD_CACHE_DIR"])
def test_offline_miss_command_warms_the_cache_that_missed(where, tmp_cache, monkeypatch):
    """The KernelNotCached message's warmup command, run as given, warms this spec for this arch
    into the cache root that missed. Without `--cache-dir <root>` it would warm the default
    cache and the offline run would miss again."""
    monkeypatch.setenv("KBUILD_OFFLINE", "1")
    spec = rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6)
    cache = DiskCache(tmp_cache / "given") if where == "argument" else None
    root = str(cache.root if cache else tmp_cache)
    with pytest.raises(KernelNotCached) as info:
        artifact_for(spec, target_for_arch("sm_90"), cache)
    command = re.search(r"kbuild warmup .*", str(info.value))
    assert command, info.value
    argv = shlex.split(command.group(0))
    assert "--cache-dir" in argv and argv[argv.index("--cache-dir") + 1] == root, argv
    warmed = []
    monkeypatch.setattr(
        cli, "warmup", lambda specs, arch, root, jobs, **_: warmed.append((specs, arch, root))
    )
    assert cli.main(argv[1:]) == 0
    assert warmed == [([spec], "sm_90", root)]


def test_offline_miss_command_quotes_a_cache_dir_with_spaces(tmp_path):
    """A cache root with a space must come back as one shell word, or the pasted warmup
    command warms a different directory."""
    import shlex

    from kbuild.jit import warmup_command
    from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec
    from kbuild.targets import target_for_arch

    root = str(tmp_path / "my cache")
    words = shlex.split(
        warmup_command(
            rmsnorm_fwd_spec(64, "f32", None, False, 1e-6), target_for_arch("sm_90"), root
        )
    )
    assert words[words.index("--cache-dir") + 1] == root
