"""Kernels users write themselves, outside the package, and per-kernel cache keys.

A kernel declared with `kbuild.kernel` in a module of its own compiles, caches and warms like
kbuild's own; its cache key covers its own file and what that imports (kbuild/cache/sources.py),
so adding a kernel leaves every other kernel's key as it was, editing one builder re-keys only
its kernels, and a user's kernel is re-keyed when its file or a module it imports changes."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from kbuild.cache.keys import entry_key, source_fingerprint
from kbuild.cache.sources import builder_files
from kbuild.registry import KERNELS, kernel_def, register
from kbuild.targets import target_for_arch

from .examples import EXAMPLE, import_example
from .row_cover import covered

SM90 = target_for_arch("sm_90")

USER_KERNEL = '''
from kbuild import Arg, Param, kernel
from kbuild.dsl import Kernel, get_llvm_ptr, if_then, load, store
from {helper} import FACTOR


@kernel("{name}", params=(Param("N", "int"),), args=(Arg("x"), Arg("y"), Arg("M", "i64")))
def build_scale(N, target):
    """y = x * FACTOR over M rows of N f32 values: one thread an element."""
    with Kernel("{name}", target, 128) as k:
        x, y, M = k.ptr("x"), k.ptr("y"), k.i64("M")
        i = k.block_id() * 128 + k.thread_id()
        if_then(i < M * N, lambda: store(load(get_llvm_ptr(x, i, "f32"), "f32") * FACTOR,
                                         get_llvm_ptr(y, i, "f32")))
    return k
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's kernel module `my_scale_<n>` in a folder of its own on sys.path, importing
    a helper module beside it; returns (import it, its folder)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"my_scale_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{name}_helper.py").write_text("FACTOR = 2.0\n")
    source = USER_KERNEL.format(name=name, helper=f"{name}_helper")
    (tmp_path / f"{name}.py").write_text(source)

    def load():
        for module in (name, f"{name}_helper"):
            sys.modules.pop(module, None)
        importlib.invalidate_caches()
        from kbuild.cache import sources

        sources.builder_fingerprint.cache_clear()
        return importlib.import_module(name).build_scale

    yield load, tmp_path, name
    KERNELS.pop(name, None)


def test_a_user_kernel_compiles_and_its_signature_is_checked(user_module):
    from kbuild import compiler

    load, _, name = user_module
    definition = load()
    assert kernel_def(name) is definition
    assert definition.builder == f"{name}:build_scale"
    kernel = compiler.build(definition.spec(N=64), SM90)
    assert kernel.signature() == [("x", "ptr"), ("y", "ptr"), ("M", "i64")]
    artifact = compiler.compile_kernel(definition.spec(N=64), SM90)
    assert artifact.entry == name and artifact.format in ("cubin", "ptx")


def test_its_key_covers_its_own_file_and_its_imports(user_module):
    load, folder, name = user_module
    definition = load()
    labels = [label for label, _ in builder_files(definition.builder)]
    assert labels == [f"{name}.py", f"{name}_helper.py"]  # relative: a checkout's path is not keyed
    spec = definition.spec(N=64)
    first = entry_key(spec, SM90)
    others = {n: source_fingerprint(n) for n in KERNELS if n != name}

    (folder / f"{name}_helper.py").write_text("FACTOR = 3.0\n")  # an import of it changes
    load()
    second = entry_key(spec, SM90)
    assert second != first
    main = folder / f"{name}.py"
    main.write_text(main.read_text() + "\n# an edit\n")  # its own file changes
    load()
    assert entry_key(spec, SM90) not in (first, second)
    assert {n: source_fingerprint(n) for n in KERNELS if n != name} == others


def test_adding_a_kernel_leaves_the_other_keys_unchanged(user_module):
    before = {name: source_fingerprint(name) for name in KERNELS}
    load, _, name = user_module
    load()
    assert {n: source_fingerprint(n) for n in KERNELS if n != name} == before


def test_editing_one_builder_rekeys_only_its_kernels(tmp_path):
    """A copy of the package: an edit to the column sum's builder (kernels/reduce.py) changes
    the keys of the kernels built from it, and no other."""
    import shutil

    import kbuild

    package = tmp_path / "kbuild"
    shutil.copytree(kbuild.__path__[0], package, ignore=shutil.ignore_patterns("__pycache__"))
    probe = textwrap.dedent("""
        import json
        from kbuild.cache.keys import source_fingerprint
        from kbuild.registry import KERNELS
        print(json.dumps({name: source_fingerprint(name) for name in KERNELS}))
    """)

    def fingerprints():
        run = subprocess.run(
            [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
            env={"PYTHONPATH": str(tmp_path), "PATH": ""},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        return __import__("json").loads(run.stdout)

    before = fingerprints()
    reduce_py = package / "kernels" / "reduce.py"
    reduce_py.write_text(reduce_py.read_text() + "\n# an edit\n")
    after = fingerprints()
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {"column_sum", "bias_grad"}
    table = package / "registry.py"  # an edit to the registry re-keys nothing
    table.write_text(table.read_text() + "\nEXTRA = 1\n")
    assert fingerprints() == after
    dsl = package / "dsl" / "values.py"  # the shared generator re-keys everything
    dsl.write_text(dsl.read_text() + "\n# an edit\n")
    last = fingerprints()
    assert all(last[name] != after[name] for name in after)


def test_a_taken_name_is_refused():
    rms = kernel_def("rmsnorm_fwd")
    clash = type(rms)("rmsnorm_fwd", "elsewhere:build", rms.params, rms.args)
    with pytest.raises(ValueError, match="kernel name 'rmsnorm_fwd' is taken"):
        register(clash)
    with pytest.raises(TypeError, match="register takes a KernelDef"):
        register("rmsnorm_fwd")


def test_a_builder_must_be_a_module_level_function():
    from kbuild import Param, kernel

    def outer():
        @kernel("nested_kernel", params=(Param("N", "int"),), args=())
        def build(N, target):
            return None

    with pytest.raises(ValueError, match="must be a module-level function"):
        outer()
    assert "nested_kernel" not in KERNELS


def test_prune_keeps_entries_of_kernels_it_does_not_know(tmp_path):
    """`prune --stale` in a process that has not imported a user's kernel module cannot
    compute that kernel's key: it keeps the entry instead of calling it stale."""
    from kbuild.artifact import Artifact
    from kbuild.cache import DiskCache
    from kbuild.cache.prune import prune
    from kbuild.spec import KernelSpec

    spec = KernelSpec.make("someone_elses_kernel", N=64)
    meta = {"target": "sm_90", "spec": spec.to_json()}
    cache = DiskCache(tmp_path)
    cache.put("ab" * 16, "cd" * 8, Artifact(b"x", "cubin", "k", meta), {"mlir": "22"})
    assert prune(cache, stale=True) == []
    assert len(list(cache.entries())) == 1


def test_the_softmax_example_runs_on_a_machine_without_a_gpu(subprocess_env, tmp_path):
    """examples/custom_softmax.py, as a user runs it: compiles its two kernels for sm_90 and
    gfx942 and checks its CPU path (values and gradients) against torch, exit 0."""
    pytest.importorskip("llvmlite")
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        env={**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    kernels = len(import_example(keep_kernels=False).warmup_specs())
    assert run.stdout.count("sm_90  user_softmax_") == kernels
    assert run.stdout.count("gfx942 user_softmax_") == kernels
    assert "cpu (8, 3, 4096) torch.bfloat16" in run.stdout


def test_warmup_names_a_users_module(subprocess_env, tmp_path):
    """`kbuild warmup --module FILE.py` warms the module's warmup_specs() (in worker
    processes too, which import the module first), and a second run finds them cached."""
    env = {**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kbuild", "warmup", "--module", str(EXAMPLE), "-j", "2"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    n = len(import_example(keep_kernels=False).warmup_specs())
    assert first.stdout.count(" compiled ") == n and f"{n} kernels for sm_90" in first.stdout
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert second.stdout.count(" cached ") == n, second.stdout
    bad = subprocess.run(
        [*command[:4], "--module", str(tmp_path / "nope.py")], env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().endswith("nope.py: no such file")


@pytest.mark.not_interpreted
def test_launch_binds_tensors_and_ints_in_the_kernels_order(monkeypatch):
    """kbuild.launch: the spec from the keywords, one memory-tier key per spec and device, the
    grid from the loaded launcher, tensors as their addresses and ints as they are."""
    import torch

    import kbuild

    from .launch_recorder import Tier, install, pretend_cuda

    tier, calls = Tier(), []
    install(monkeypatch, tier.get_launcher)
    pretend_cuda(monkeypatch)
    monkeypatch.setattr(
        "tests.launch_recorder.FakeLauncher.__call__",
        lambda self, grid, stream, *args: calls.append((grid, stream, args)),
    )
    colsum = kernel_def("column_sum")
    partial, out = torch.zeros(4, 64), torch.zeros(64, dtype=torch.bfloat16)
    kbuild.launch(
        colsum, lambda got: 3 * got.rows_per_block, partial, out, 4, N=64, out_dtype="bf16"
    )
    ((key, _, spec),) = tier.requests
    assert spec == colsum.spec(N=64, out_dtype="bf16")
    assert key == ("column_sum", (("N", 64), ("out_dtype", "bf16")), -1)
    signature = [("partial", "ptr"), ("out", "ptr"), ("R", "i64")]

    def signed(key, device, make_spec):  # a launcher whose metadata has its signature
        launcher = tier.get_launcher(key, device, make_spec)
        launcher.meta = {"signature": signature}
        return launcher

    install(monkeypatch, signed)
    with pytest.raises(TypeError, match="argument out must be a tensor, got int"):
        kbuild.launch(colsum, 1, partial, 12345, 4, N=64, out_dtype="bf16")
    with pytest.raises(TypeError, match="argument R must be an int, got Tensor"):
        kbuild.launch(colsum, 1, partial, out, out, N=64, out_dtype="bf16")
    with pytest.raises(TypeError, match="column_sum takes 3 arguments"):
        kbuild.launch(colsum, 1, partial, out, N=64, out_dtype="bf16")
    assert calls == [(6, 0, (partial.data_ptr(), out.data_ptr(), 4))]
    with pytest.raises(TypeError, match="args are tensors and ints, got float"):
        kbuild.launch(colsum, 1, partial, out, 4.0, N=64, out_dtype="bf16")
    with pytest.raises(ValueError, match="no tensor"):
        kbuild.launch(colsum, 1, 4, N=64, out_dtype="bf16")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="one CUDA device, got \\['cpu'\\]"):
        kbuild.launch(colsum, 1, partial, out, 4, N=64, out_dtype="bf16")


def test_show_prints_a_users_kernel_named_with_its_module(subprocess_env, tmp_path):
    label = "user_softmax_fwd(N=4096, dtype=bf16)"
    env = {**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path)}
    show = [sys.executable, "-m", "kbuild", "show", label]
    run = subprocess.run([*show, "--module", str(EXAMPLE)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert ".entry user_softmax_fwd" in run.stdout and "ex2.approx.f32" in run.stdout
    unknown = subprocess.run(show, env=env, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown kernel 'user_softmax_fwd'" in unknown.stderr


def test_the_example_imports_where_there_is_no_mlir(subprocess_env):
    """The GPU machine runs from a warmed cache with no MLIR: a user's kernel module must
    import there (its builders import the DSL inside), or nothing of it can launch."""
    from .no_mlir import HIDE_MLIR

    code = HIDE_MLIR + (
        f"sys.path.insert(0, {str(EXAMPLE.parent)!r})\n"
        "import custom_softmax\n"
        "from kbuild.cache.keys import source_fingerprint\n"
        "print(source_fingerprint('user_softmax_fwd'), 'mlir' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[1] == "False"


def test_the_key_names_the_code_the_process_runs_not_a_later_edit(user_module):
    """A builder edited on disk after its module was imported: this process still runs the
    old code, so its key must stay the old one (a key of the new file over the old binary
    would hand the stale binary to every process that runs the new file)."""
    load, folder, name = user_module
    definition = load()
    spec = definition.spec(N=64)
    before = entry_key(spec, SM90)
    main = folder / f"{name}.py"
    main.write_text(main.read_text().replace('"f32") * FACTOR', '"f32") * FACTOR * 2'))
    assert entry_key(spec, SM90) == before  # declared source, not the disk's
    load()  # a process importing the edited file
    assert entry_key(spec, SM90) != before


def test_one_file_one_key_however_it_is_imported(tmp_path, subprocess_env):
    """The same kernel file imported as `mod`, as `pkg.mod`, run as `python -m pkg.mod` and
    reached through a symbolic link gets one key (a cache warmed one way must hit the other)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("FACTOR = 2.0\n")
    body = USER_KERNEL.format(name="one_file_kernel", helper="helper").replace(
        "from helper import FACTOR",
        "try:\n    from .helper import FACTOR\nexcept ImportError:\n    from helper import FACTOR",
    )
    (package / "mod.py").write_text(
        body + "\nif __name__ == '__main__':\n"
        "    from kbuild.cache.keys import source_fingerprint\n"
        "    print(source_fingerprint('one_file_kernel'))\n"
    )
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "mod.py").symlink_to(package / "mod.py")
    (tmp_path / "linked" / "helper.py").symlink_to(package / "helper.py")
    probe = (
        "import importlib, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "importlib.import_module(sys.argv[2])\n"
        "from kbuild.cache.keys import source_fingerprint\n"
        "print(source_fingerprint('one_file_kernel'))\n"
    )

    def key(*args: str, cwd=None) -> str:
        run = subprocess.run(
            [sys.executable, *args], env=subprocess_env, cwd=cwd, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.split()[-1]

    keys = {
        key("-c", probe, str(package), "mod"),
        key("-c", probe, str(tmp_path), "pkg.mod"),
        key("-m", "pkg.mod", cwd=tmp_path),
        key("-c", probe, str(tmp_path / "linked"), "mod"),
    }
    assert len(keys) == 1, keys


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_the_examples_passes_cover_every_column_once(arch):
    """Each pass of the example's kernels (RowTile.over_chunks, its loads' columns) covers
    every column of its block's slice exactly once, and the slices cover the row, on every
    warmed shape: the rows long enough to be chunked (N = 32768 on gfx942, 151936 on both)
    included, which a single load at start 0 once left mostly unread."""
    example = import_example(keep_kernels=False)  # later modules see kbuild's own kernels
    from kbuild.plan.config import RowBudget
    from kbuild.plan.rows import plan_rows

    target = target_for_arch(arch)
    chunked = set()
    for spec in example.warmup_specs():
        held = 1 if spec.kernel.endswith("fwd") else 2
        p = spec.kwargs
        budget = RowBudget(words_per_elem=float(held))
        row = plan_rows(
            p["N"], p["dtype"], target, vectorize=p["vectorize"], budget=budget, persistent=False
        ).row
        for hits in covered(row, lambda phase: phase):  # every phase of a peeled row
            assert set(hits) == {1}, spec.short()
        assert row.slice * row.cluster >= p["N"] > row.slice * (row.cluster - 1), spec.short()
        chunked |= {p["N"]} if row.chunked else set()
    assert 151936 in chunked
