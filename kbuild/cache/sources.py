"""Which source files shape a kernel's binary, and their fingerprint: one per kernel.

A kernel's binary follows from two kinds of source:

- the code generator every kernel shares: the DSL (`kbuild/dsl`), the targets, the compiler,
  the spec and dtype tables (`BASE_DIRS`, `BASE_FILES`), hashed whole;
- the kernel's own builder module and the modules it imports, followed from file to file by
  reading their imports (ast: nothing is imported, no MLIR is needed). The walk follows an
  import into kbuild (`kbuild/plan/norms.py`, say) and into the builder's own code: its
  package, or for a builder that is a module of its own (a user's `my_softmax.py`), the
  modules beside it. Third-party imports (mlir, numpy) are the toolchain key's business.

So adding a kernel, or editing one builder, re-keys only the kernels whose builders reach the
edited file, and a user's kernel defined outside kbuild is re-keyed when its own file or a
module it imports changes. Labels are paths relative to the package root or to the user's
builder's folder, never absolute, so a cache warmed in one checkout hits in another.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
from pathlib import Path

PACKAGE = Path(os.path.abspath(__file__)).parents[1]  # kbuild/, as imported
# The shared code generator, relative to the package. Closed under imports, bar the compiler's
# dispatch to the kernel table (tests/test_fingerprint_cpu.py checks it).
BASE_DIRS = ("dsl", "targets")
BASE_FILES = ("spec.py", "compiler.py", "dtypes.py", "trace_layout.py", "artifact.py")
# What describes kernels rather than generating them: the package root (lazy names only) and
# the registry (kernels by name, and `kernel`). The walk never enters them, so declaring a
# kernel or a user's `from kbuild import kernel` re-keys nothing; the signature check at build
# time holds a description to its builder.
# A package's __init__.py that holds only its docstring (kernels/norms/, plan/) describes too.


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_bytes()).body
    return (
        len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    )


DESCRIPTIONS = ("__init__.py", "registry.py") + tuple(
    sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("__init__.py")
        if path != PACKAGE / "__init__.py" and _docstring_only(path)
    )
)
_DESCRIBED = frozenset(PACKAGE / name for name in DESCRIPTIONS)


def _hash(files: list[tuple[str, Path]], seed: str = "") -> str:
    """sha256 of the files' labels and bytes, each length-prefixed (no two different sets
    hash alike; a rename is a change), 16 hex characters."""
    digest = hashlib.sha256(seed.encode())
    for label, path in sorted(files):
        data = path.read_bytes()
        digest.update(f"{len(label)}:{label}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def base_files(package: Path = PACKAGE) -> list[tuple[str, Path]]:
    """The shared code generator's `*.py` files as sorted (label, path)."""
    files = [path for name in BASE_DIRS for path in (package / name).rglob("*.py")]
    files += [package / name for name in BASE_FILES if (package / name).is_file()]
    return sorted((path.relative_to(package).as_posix(), path) for path in files)


@functools.cache
def base_fingerprint() -> str:
    """The shared code generator, hashed once per process (16 hex)."""
    return _hash(base_files())


class _Walk:
    """Where a walk from one builder may go: into kbuild's package, and into the builder's
    own import root (the sys.path entry its top-level package or module lies in). From a
    root in site-packages only the builder's own package is followed, not its neighbours.
    Paths are kept as Python imports them (symbolic links not followed), and a user's files
    are labelled relative to the builder's folder, so importing the same file as `mod` or as
    `pkg.mod` gives one key."""

    def __init__(self, builder_module: str, builder_file: Path) -> None:
        depth = builder_module.count(".") + (builder_file.name == "__init__.py")
        self.root = builder_file.parents[depth]
        self.home = builder_file.parent
        self.top = builder_module.split(".")[0]
        self.shared = not {"site-packages", "dist-packages"}.isdisjoint(self.root.parts)

    def file_of(self, module: str) -> Path | None:
        """The file of `module` where the walk follows it, else None."""
        parts = module.split(".")
        if parts[0] == "kbuild":
            stem = PACKAGE.joinpath(*parts[1:])
        elif parts[0] == self.top or not self.shared:
            stem = self.root.joinpath(*parts)
        else:
            return None
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                return None if candidate in _DESCRIBED else candidate
        return None

    def module_of(self, path: Path) -> str:
        root = PACKAGE.parent if path.is_relative_to(PACKAGE) else self.root
        parts = list(path.relative_to(root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def label(self, path: Path) -> str:
        if path.is_relative_to(PACKAGE):
            return "kbuild/" + path.relative_to(PACKAGE).as_posix()
        return Path(os.path.relpath(path, self.home)).as_posix()

    def imports(self, path: Path) -> set[Path]:
        """The files of what `path` imports that the walk follows, at any depth: for
        `from X import y`, X.y's file where y is a module, else X's (its __init__). The
        packages above a module imported from them are not read: their code runs, but a
        kernel gets nothing from it it does not import by name."""
        module = self.module_of(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[Path | None] = set()
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {self.file_of(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    found.add(self.file_of(f"{target}.{alias.name}") or self.file_of(target))
        return {f for f in found if f is not None}


def builder_files(builder: str, file: str | Path | None = None) -> list[tuple[str, Path]]:
    """(label, path) of the builder's module (`"module:function"`; its file as imported,
    found by name unless `file` says) and every module it reaches through imports the walk
    follows, the shared code generator excluded."""
    module = builder.split(":")[0]
    if file is None:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"builder {builder!r}: no Python source found for {module!r}")
        file = spec.origin
    start = Path(os.path.abspath(file))
    walk = _Walk(module, start)
    shared = {path for _, path in base_files()}
    seen, todo = {start}, [start]
    while todo:
        for found in walk.imports(todo.pop()) - seen:
            seen.add(found)
            if found not in shared:  # the shared generator is hashed whole
                todo.append(found)
    return sorted((walk.label(p), p) for p in seen - shared)


def fingerprint(builder: str, file: str | Path | None = None) -> str:
    """A kernel's source fingerprint (16 hex): the shared code generator plus its builder's
    own files, read now."""
    return _hash(builder_files(builder, file), seed=base_fingerprint())


@functools.cache
def builder_fingerprint(builder: str) -> str:
    """`fingerprint`, once per process and builder (kbuild's own kernels; a kernel declared
    with `kbuild.kernel` keeps the one taken when it was declared)."""
    return fingerprint(builder)
