"""The kernel-source fingerprints (kbuild.cache.sources) cover everything that generates code.

Each kernel's key covers the shared code generator (dsl, targets, compiler) and its builder's
own files; together they are the fingerprinted set, which must be closed under imports (bar
the descriptions: the table and the package root, which describe kernels and generate
none): a fingerprinted module that imports a kbuild
module outside the set (dsl/trace.py once took its layout from kbuild/timing.py) changes
generated code when that module is edited, without changing any cache key, and a warmed
cache then hands out stale binaries. Imports are read from the source (ast), so neither MLIR
nor torch is needed, and imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kbuild
from kbuild.cache.sources import DESCRIPTIONS, _hash, base_files, builder_files
from kbuild.registry import BUILTIN, KERNELS

# kbuild's own kernels: a user's, registered by another test module, are not the package's.
OWN = {name: KERNELS[name] for name in sorted(BUILTIN)}

PACKAGE = Path(kbuild.__file__).parent
# Third-party packages code-generating modules may import: those whose versions the
# toolchain key records (kbuild.compiler.toolchain: the MLIR bindings and LLVM tools).
# Packages whose versions the toolchain key records (compiler.toolchain): mlir for every
# target, llvmlite (and its LLVM) for AMD code objects.
TOOLCHAIN_PACKAGES = {"mlir", "llvmlite"}


def _fingerprinted() -> dict[str, Path]:
    files = dict(base_files())
    for definition in OWN.values():
        files.update(
            (label.removeprefix("kbuild/"), path)
            for label, path in builder_files(definition.builder)
        )
    return files


def _module_name(rel: str) -> str:
    parts = ["kbuild", *rel[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_of(module: str) -> str | None:
    """The package-relative file of the kbuild module `module`, or None if there is none."""
    rel = "/".join(module.split(".")[1:])
    for candidate in (f"{rel}.py", f"{rel}/__init__.py" if rel else "__init__.py"):
        if (PACKAGE / candidate).is_file():
            return candidate
    return None


def _imported_modules(rel: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth: for
    `from X import y`, X and, where y is a submodule, X.y."""
    package = _module_name(rel)
    if not rel.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target))
            for alias in node.names:
                if target.split(".")[0] == "kbuild" and _file_of(f"{target}.{alias.name}"):
                    out.append((node.lineno, f"{target}.{alias.name}"))
    return out


def _loaded_files(module: str) -> list[str | None]:
    """What importing the kbuild module `module` runs: its file and its packages' __init__
    files, bar the root's (test_the_package_root_imports_nothing_at_import_time)."""
    parts = module.split(".")
    return [_file_of(".".join(parts[:n])) for n in range(2, len(parts) + 1)]


def _edges() -> list[tuple[str, int, str, str | None]]:
    """(importer, line, module, file) for every kbuild import of a fingerprinted module."""
    edges = []
    for rel, path in _fingerprinted().items():
        for line, module in _imported_modules(rel, path):
            if module.split(".")[0] == "kbuild":
                edges += [(rel, line, module, file) for file in _loaded_files(module)]
    return edges


def test_fingerprinted_modules_import_only_fingerprinted_modules():
    fingerprinted = _fingerprinted()
    outside = [
        f"{rel}:{line} imports {module} ({file or 'no such module'})"
        for rel, line, module, file in _edges()
        if file not in fingerprinted and file not in DESCRIPTIONS
    ]
    assert not outside, "code generation reads modules the cache key does not cover:\n" + (
        "\n".join(outside)
    )


def test_the_walk_sees_the_imports_that_matter():
    # The checks above are not vacuous: the trace layout, relative imports two levels up and
    # imports inside functions are all followed.
    edges = {(rel, file) for rel, _, _, file in _edges()}
    assert ("dsl/trace.py", "trace_layout.py") in edges
    assert ("dsl/values.py", "dtypes.py") in edges  # from ..dtypes import ...
    assert ("compiler.py", "targets/nvidia.py") in edges  # inside a function
    assert ("kernels/norms/forward.py", "dsl/__init__.py") in edges


def test_code_generating_modules_import_only_the_stdlib_and_the_toolchain():
    # A third-party package whose version no key records (torch, which kbuild.timing imports,
    # came in with the trace layout) must not shape generated code either.
    foreign = sorted(
        f"{rel}:{line} imports {module}"
        for rel, path in _fingerprinted().items()
        for line, module in _imported_modules(rel, path)
        if module.split(".")[0] not in {"kbuild", *TOOLCHAIN_PACKAGES}
        and module.split(".")[0] not in sys.stdlib_module_names
    )
    assert not foreign, "\n".join(foreign)


def test_builders_imported_by_name_are_fingerprinted():
    for kernel, definition in OWN.items():
        module = definition.builder.split(":")[0]
        labels = [label for label, _ in builder_files(definition.builder)]
        assert f"kbuild/{_file_of(module)}" in labels, f"{kernel}: {definition.builder}"


def test_the_package_root_imports_nothing_at_import_time():
    # kbuild/__init__.py runs before any fingerprinted module and is not fingerprinted itself:
    # it may load kbuild modules only lazily (inside functions).
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = [
        node.lineno
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        and not (isinstance(node, ast.Import) and all(a.name == "importlib" for a in node.names))
    ]
    assert not eager, f"kbuild/__init__.py imports at lines {eager}"


def test_an_edit_of_the_trace_layout_changes_the_fingerprint(tmp_path):
    (tmp_path / "dsl").mkdir()
    (tmp_path / "dsl" / "trace.py").write_text("from ..trace_layout import TRACE_ITERATIONS\n")
    (tmp_path / "trace_layout.py").write_text("TRACE_ITERATIONS = 64\n")
    assert "trace_layout.py" in dict(base_files(tmp_path))
    base = _hash(base_files(tmp_path))
    (tmp_path / "trace_layout.py").write_text("TRACE_ITERATIONS = 128\n")
    assert _hash(base_files(tmp_path)) != base


def test_the_trace_layout_imports_without_mlir_or_torch():
    # bench/trace_rows.py reads it on the GPU machine, which has no MLIR.
    code = (
        "import sys; from kbuild.trace_layout import TRACE_POINTS, TRACE_WORDS; "
        "assert TRACE_WORDS == len(TRACE_POINTS) + 1; "
        "assert not {'mlir', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
