"""CPU tests of the compile cache: keys, the disk store under damage, memory tier (contention
between processes: test_cache_locking.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kbuild.artifact import Artifact
from kbuild.cache import (
    DiskCache,
    MemoryCache,
    default_cache_dir,
    entry_key,
    source_fingerprint,
    toolchain_key,
)
from kbuild.kernels.norms.kernels import RMSNORM_BWD, RMSNORM_FWD
from kbuild.registry import _REQUIRED, KERNELS, KernelDef
from kbuild.spec import KernelSpec
from kbuild.targets import target_for_arch

SM90 = target_for_arch("sm_90")
TOOLCHAIN = {"mlir": "22.1.8.4", "llvm": "22.1.8.2", "ptxas": "13.0.88"}
NEWER_TOOLCHAIN = {"mlir": "22.1.8.5", "llvm": "22.1.8.2", "ptxas": "13.0.88"}


def make_spec(**overrides) -> KernelSpec:
    params = {"N": 4096, "dtype": "bf16", "eps": 1e-5, "store_rstd": False} | overrides
    return KernelSpec.make("rmsnorm_fwd", **params)


def make_artifact(tag: bytes = b"") -> Artifact:
    binary = b"\x7fELF" + tag + bytes(range(256)) * 4
    return Artifact(binary, "cubin", "rmsnorm_fwd_kernel", {"block": [256, 1, 1], "smem": 0})


@pytest.fixture
def keys() -> tuple[str, str]:
    return entry_key(make_spec(), SM90), toolchain_key(TOOLCHAIN)


# --- keys ---------------------------------------------------------------------------------


def test_entry_key_is_stable_and_ignores_param_order():
    a = KernelSpec.make("rmsnorm_fwd", N=4096, dtype="bf16", eps=1e-5, store_rstd=False)
    b = KernelSpec.make("rmsnorm_fwd", store_rstd=False, eps=1e-5, dtype="bf16", N=4096)
    assert entry_key(a, SM90) == entry_key(b, SM90) == entry_key(make_spec(), SM90)
    assert len(entry_key(a, SM90)) == 32
    int(entry_key(a, SM90), 16)


@pytest.mark.parametrize(
    "change",
    [{"eps": 1e-6}, {"N": 8192}, {"dtype": "fp16"}, {"store_rstd": True}],
    ids=["eps", "N", "dtype", "store_rstd"],
)
def test_entry_key_changes_with_every_param(change):
    assert entry_key(make_spec(**change), SM90) != entry_key(make_spec(), SM90)


def _one_param_changes(kdef: KernelDef):
    """(name, base spec, the spec with only that parameter changed) for each parameter of
    the table entry: a weight and every flag set, so a parameter that `needs` one means
    something; the changed value is another of the parameter's kind."""
    base: dict = {}
    for p in kdef.params:
        if p.default is not _REQUIRED:
            base[p.name] = p.default  # offset 0, strided False, residual_in_dtype None, ...
        else:  # a weight (dtype?), every flag set
            base[p.name] = {"int": 4096, "float": 1e-5, "bool": True, "index": "i32"}.get(
                p.kind, "bf16"
            )
    for p in kdef.params:
        value = base[p.name]
        other = {
            "int": lambda v: v * 2,
            "float": lambda v: v + 1.0,  # offset 0 -> 1 (Gemma), eps 1e-5 -> 1 + 1e-5
            "bool": lambda v: not v,
            "dtype": lambda v: "f16" if v != "f16" else "f32",
            "dtype?": lambda v: "f32" if v != "f32" else "f16",
            "index": lambda v: "i64" if v != "i64" else "i32",
        }[p.kind](value)
        yield p.name, kdef.spec(**base), kdef.spec(**(base | {p.name: other}))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_entry_key_changes_with_every_table_param(name):
    """Catches an entry key (or the spec's canonical JSON it hashes) that leaves out a
    compile-time parameter, e.g. RMSNorm's weight `offset`: Gemma's offset-1 call would be
    served the plain kernel from the disk cache."""
    for param, base, changed in _one_param_changes(KERNELS[name]):
        assert changed != base, (name, param)  # the table keeps the change in the spec
        assert entry_key(changed, SM90) != entry_key(base, SM90), (name, param)
        # meta.json's spec (read back by `cache prune --stale`) names the same entry
        again = KernelSpec.from_json(json.loads(json.dumps(changed.to_json())))
        assert entry_key(again, SM90) == entry_key(changed, SM90), (name, param)


def test_the_weight_offset_is_keyed_only_when_nonzero():
    """Catches RMSNorm's `offset` dropped from the key (a stale plain kernel served for
    Gemma), and an offset of 0 keyed anyway (every warmed plain entry would miss)."""
    flags = {RMSNORM_FWD: {"store_rstd": True, "eps": 1e-6}, RMSNORM_BWD: {"compute_dw": True}}
    for kdef, more in flags.items():
        plain, zero, gemma = (
            kdef.spec(N=4096, dtype="bf16", weight_dtype="bf16", **more, **offset)
            for offset in ({}, {"offset": 0}, {"offset": 1.0})
        )
        assert "offset" not in plain.canonical_json() and zero == plain
        assert entry_key(zero, SM90) == entry_key(plain, SM90)
        assert entry_key(gemma, SM90) != entry_key(plain, SM90)


def test_entry_key_changes_with_target_and_kernel_name():
    spec = make_spec()
    assert entry_key(spec, target_for_arch("sm_80")) != entry_key(spec, SM90)
    other = KernelSpec.make("rmsnorm_bwd", **spec.kwargs)
    assert entry_key(other, SM90) != entry_key(spec, SM90)


def test_eps_keyed_by_exact_bits():
    close = 1e-5 * (1 + 2**-40)
    assert entry_key(make_spec(eps=close), SM90) != entry_key(make_spec(), SM90)


def test_toolchain_key():
    reordered = dict(reversed(list(TOOLCHAIN.items())))
    assert toolchain_key(reordered) == toolchain_key(TOOLCHAIN)
    assert toolchain_key(NEWER_TOOLCHAIN) != toolchain_key(TOOLCHAIN)
    assert len(toolchain_key(TOOLCHAIN)) == 16
    with pytest.raises(TypeError, match="toolchain"):
        toolchain_key({"mlir": 22})


def test_source_fingerprint_is_cached_hex():
    from kbuild.cache.sources import builder_fingerprint

    builder = "kbuild.kernels.norms.kernels:build_rmsnorm_module"
    assert builder_fingerprint(builder) is builder_fingerprint(builder)
    assert len(source_fingerprint("rmsnorm_fwd")) == 16
    int(source_fingerprint("rmsnorm_fwd"), 16)


def test_the_base_fingerprint_sees_edits_renames_and_only_codegen_files(tmp_path):
    from kbuild.cache.sources import _hash, base_files

    (tmp_path / "dsl").mkdir()
    (tmp_path / "runtime").mkdir()
    (tmp_path / "dsl" / "values.py").write_text("N = 1\n")
    (tmp_path / "spec.py").write_text("x = 1\n")
    base = _hash(base_files(tmp_path))
    (tmp_path / "runtime" / "loader.py").write_text("unrelated\n")
    assert _hash(base_files(tmp_path)) == base
    (tmp_path / "dsl" / "values.py").write_text("N = 2\n")
    edited = _hash(base_files(tmp_path))
    assert edited != base
    (tmp_path / "dsl" / "values.py").rename(tmp_path / "dsl" / "memory.py")
    assert _hash(base_files(tmp_path)) != edited


def test_put_then_get_round_trips(tmp_path, keys):
    cache = DiskCache(tmp_path)
    artifact = make_artifact()
    directory = cache.put(*keys, artifact, TOOLCHAIN)
    assert directory == tmp_path / keys[0][:2] / keys[0] / keys[1]
    got = cache.get(*keys)
    assert got == artifact
    assert got.binary == artifact.binary and got.meta == {"block": [256, 1, 1], "smem": 0}
    assert cache.get(keys[0], None) == artifact
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["toolchain"] == TOOLCHAIN and meta["size"] == len(artifact.binary)


def test_other_toolchain_misses_and_none_takes_newest(tmp_path, keys):
    cache = DiskCache(tmp_path)
    newer = toolchain_key(NEWER_TOOLCHAIN)
    cache.put(keys[0], keys[1], make_artifact(b"old"), TOOLCHAIN)
    assert cache.get(keys[0], newer) is None
    assert cache.get(entry_key(make_spec(N=8192), SM90), None) is None
    cache.put(keys[0], newer, make_artifact(b"new"), NEWER_TOOLCHAIN)
    assert cache.get(keys[0], None) == make_artifact(b"new")
    assert cache.get(*keys) == make_artifact(b"old")
    cache.put(keys[0], keys[1], make_artifact(b"old2"), TOOLCHAIN)  # rewritten: newest again
    assert cache.get(keys[0], None) == make_artifact(b"old2")


def test_none_lookup_falls_back_past_a_damaged_newest(tmp_path, keys):
    cache = DiskCache(tmp_path)
    cache.put(keys[0], keys[1], make_artifact(b"old"), TOOLCHAIN)
    newest = cache.put(keys[0], toolchain_key(NEWER_TOOLCHAIN), make_artifact(), NEWER_TOOLCHAIN)
    (newest / "kernel.cubin").write_bytes(b"torn")
    assert cache.get(keys[0], None) == make_artifact(b"old")


def test_bad_keys_and_formats_are_rejected(tmp_path, keys):
    cache = DiskCache(tmp_path)
    with pytest.raises(ValueError, match="entry_key"):
        cache.get("../../etc", None)
    with pytest.raises(ValueError, match="toolchain_key"):
        cache.put(keys[0], "x/y", make_artifact(), TOOLCHAIN)
    with pytest.raises(ValueError, match="format"):
        cache.put(*keys, Artifact(b"x", "../bin", "k"), TOOLCHAIN)
    with pytest.raises(TypeError):
        cache.put(*keys, Artifact(b"x", "cubin", "k", {"bad": object()}), TOOLCHAIN)
    assert not any(tmp_path.iterdir())


# --- disk: damage is a miss ---------------------------------------------------------------


def _truncate(d: Path) -> None:
    path = d / "kernel.cubin"
    path.write_bytes(path.read_bytes()[:10])


def _flip_byte(d: Path) -> None:
    path = d / "kernel.cubin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _garbage_meta(d: Path) -> None:
    (d / "meta.json").write_bytes(b"{not json \xff")


def _meta_not_an_object(d: Path) -> None:
    (d / "meta.json").write_text("[1, 2, 3]")


def _meta_missing_field(d: Path) -> None:
    meta = json.loads((d / "meta.json").read_text())
    del meta["sha256"]
    (d / "meta.json").write_text(json.dumps(meta))


def _meta_wrong_type(d: Path) -> None:
    meta = json.loads((d / "meta.json").read_text())
    meta["size"] = "4100"
    (d / "meta.json").write_text(json.dumps(meta))


def _delete_binary(d: Path) -> None:
    (d / "kernel.cubin").unlink()


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _flip_byte,
        _garbage_meta,
        _meta_not_an_object,
        _meta_missing_field,
        _meta_wrong_type,
        _delete_binary,
    ],
)
def test_damage_is_a_miss_and_put_repairs(tmp_path, keys, damage):
    cache = DiskCache(tmp_path)
    directory = cache.put(*keys, make_artifact(), TOOLCHAIN)
    damage(directory)
    assert cache.get(*keys) is None
    assert not (directory / "meta.json").exists()  # the damaged entry was removed
    assert cache.get(keys[0], None) is None
    assert list(cache.entries()) == []
    cache.put(*keys, make_artifact(), TOOLCHAIN)
    assert cache.get(*keys) == make_artifact()


def test_an_entry_pruned_between_its_meta_and_its_binary_is_a_miss(tmp_path, keys, monkeypatch):
    # A prune in another process can remove the whole entry directory after a reader has
    # read its meta.json: the reader's clean-up of the "missing" binary must not fail on the
    # missing directory, the load is a plain miss. Python 3.11's glob raises
    # FileNotFoundError when the directory goes between its own check and its listing (seen
    # in CI, test_prune_cpu.py); the glob below always lists, so the race is not needed.
    cache = DiskCache(tmp_path)
    cache.put(*keys, make_artifact(), TOOLCHAIN)
    read_meta = DiskCache._meta

    def meta_then_pruned(self, directory):
        meta = read_meta(self, directory)
        shutil.rmtree(directory)
        return meta

    def listing(self, pattern):
        return iter(list(os.scandir(self)))  # FileNotFoundError for a directory that went

    monkeypatch.setattr(DiskCache, "_meta", meta_then_pruned)
    monkeypatch.setattr(Path, "glob", listing)
    assert cache.get(*keys) is None
    assert cache.get(keys[0], None) is None


def test_read_only_leaves_damage_alone(tmp_path, keys):
    directory = DiskCache(tmp_path).put(*keys, make_artifact(), TOOLCHAIN)
    _flip_byte(directory)
    assert DiskCache(tmp_path, read_only=True).get(*keys) is None
    assert (directory / "meta.json").exists()


# --- disk: atomic writes and build-once ---------------------------------------------------
# Across processes (the lock, publication while others read) see test_cache_locking.py.


def test_put_leaves_no_temp_files(tmp_path, keys):
    cache = DiskCache(tmp_path)
    directory = cache.put(*keys, make_artifact(), TOOLCHAIN)
    cache.put(*keys, make_artifact(b"again"), TOOLCHAIN)
    assert sorted(p.name for p in directory.iterdir()) == ["kernel.cubin", "meta.json"]


def test_failed_build_writes_nothing_and_releases_the_lock(tmp_path, keys):
    cache = DiskCache(tmp_path)

    def broken() -> Artifact:
        raise RuntimeError("ptxas crashed")

    with pytest.raises(RuntimeError, match="ptxas"):
        cache.get_or_build(*keys, TOOLCHAIN, broken)
    assert cache.get(*keys) is None
    assert list(cache.entries()) == []
    lock = cache.lock(*keys)
    lock.acquire(timeout=0)  # raises Timeout if the failed build still held it
    lock.release()
    artifact, built = cache.get_or_build(*keys, TOOLCHAIN, make_artifact)
    assert built and artifact == make_artifact()
    artifact, built = cache.get_or_build(*keys, TOOLCHAIN, broken)
    assert not built and artifact == make_artifact()


# --- disk: read-only, listing, clearing ---------------------------------------------------


def test_read_only_gets_but_never_writes(tmp_path, keys):
    DiskCache(tmp_path).put(*keys, make_artifact(), TOOLCHAIN)
    cache = DiskCache(tmp_path, read_only=True)
    assert cache.get(*keys) == make_artifact()
    other = toolchain_key(NEWER_TOOLCHAIN)
    with pytest.raises(RuntimeError, match="read-only"):
        cache.put(keys[0], other, make_artifact(), NEWER_TOOLCHAIN)
    with pytest.raises(RuntimeError, match="read-only"):
        cache.clear()
    artifact, built = cache.get_or_build(keys[0], other, NEWER_TOOLCHAIN, make_artifact)
    assert built and artifact == make_artifact()
    assert cache.get(keys[0], other) is None
    assert not list((tmp_path / keys[0][:2] / keys[0]).glob("*.lock"))
    empty = DiskCache(tmp_path / "absent", read_only=True)
    assert empty.get(*keys) is None and not (tmp_path / "absent").exists()


def test_entries_and_clear(tmp_path, keys):
    cache = DiskCache(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own file")
    cache.put(*keys, make_artifact(), TOOLCHAIN)
    second = entry_key(make_spec(N=8192), SM90)
    cache.get_or_build(second, keys[1], TOOLCHAIN, make_artifact)
    listed = {(d.parent.name, d.name): meta for d, meta in cache.entries()}
    assert set(listed) == {keys, (second, keys[1])}
    assert listed[keys]["meta"] == make_artifact().meta
    cache.clear()
    assert list(cache.entries()) == [] and cache.get(*keys) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KBUILD_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KBUILD_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "kbuild"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kbuild"


# --- memory tier --------------------------------------------------------------------------


def test_memory_cache_bound_evicts_oldest():
    cache = MemoryCache(capacity=2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert len(cache) == 2 and cache.get("a") is None
    assert cache.keys() == ["b", "c"] and cache.get("c") == 3
    cache.put("b", 20)  # a re-put counts as new
    cache.put("d", 4)
    assert cache.keys() == ["b", "d"] and cache.get("b") == 20
    cache.clear()
    assert len(cache) == 0 and cache.get("b") is None
    cache.put("e", 5)
    assert cache.get("e") == 5


def test_memory_cache_keys_by_device():
    cache = MemoryCache()
    spec = make_spec()
    cache.put((spec, 0), "module on cuda:0")
    cache.put((spec, 1), "module on cuda:1")
    assert cache.get((spec, 0)) == "module on cuda:0"
    assert cache.get((make_spec(), 1)) == "module on cuda:1"
    assert cache.get((spec, 2)) is None and len(cache) == 2


def test_memory_cache_capacity(monkeypatch):
    monkeypatch.delenv("KBUILD_MEMORY_CACHE_SIZE", raising=False)
    assert MemoryCache().capacity == 4096
    monkeypatch.setenv("KBUILD_MEMORY_CACHE_SIZE", "3")
    assert MemoryCache().capacity == 3
    monkeypatch.setenv("KBUILD_MEMORY_CACHE_SIZE", "lots")
    with pytest.raises(ValueError, match="KBUILD_MEMORY_CACHE_SIZE"):
        MemoryCache()
    with pytest.raises(ValueError, match="capacity"):
        MemoryCache(capacity=0)


def test_cache_imports_neither_torch_nor_mlir():
    code = "import sys, kbuild.cache; print(sorted({'torch', 'mlir'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
