"""Kernels declared beside their builders, outside kbuild's table: a user's own.

    from kbuild import Arg, Param, kernel

    @kernel("my_scale", params=(Param("N", "int"), Param("dtype", "dtype")),
            args=(Arg("x"), Arg("y"), Arg("M", "i64")))
    def build_scale(N, dtype, target):
        with Kernel("my_scale", target, block) as k: ...   # kbuild.dsl
        return k

`kernel` registers a KernelDef whose builder is the decorated function, found again by its
module and name (so worker processes, `kbuild warmup --module` and a machine running from a
warmed cache find it too), with its source fingerprint taken then, and returns the
definition: `MY_SCALE.spec(4096, "bf16")` names a kernel, `kbuild.launch(MY_SCALE, grid, x,
y, M, N=4096, dtype="bf16")` runs it. Its cache key covers the builder's own file and what it
imports (kbuild/cache/sources.py): editing it re-keys its kernels only. Pure Python: no MLIR,
no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from .table import Arg, KernelDef, Param, register


def _module_name(function: Callable) -> str:
    """The importable name of the function's module: a script run as `python file.py` is
    `__main__` here but imports as its file's stem (its folder is on sys.path); one run as
    `python -m pkg.mod` imports as pkg.mod."""
    module = function.__module__
    if module != "__main__":
        return module
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is not None:
        return main.__spec__.name
    path = getattr(main, "__file__", None)
    if path is None:
        raise ValueError(
            f"{function.__qualname__}: a kernel's builder must live in a file (a module or a "
            "script), not in an interactive session: kbuild imports it again to compile"
        )
    return Path(path).stem


def kernel(
    name: str,
    params: Iterable[Param],
    args: Iterable[Arg],
    *,
    tunable: bool = False,
) -> Callable[[Callable], KernelDef]:
    """Declare the decorated builder `fn(**params, target) -> dsl.Kernel` as the kernel
    `name`: compile-time `params` (what the spec and the cache key hold) and launch `args` in
    the order the kernel takes them (checked against every built kernel's signature)."""
    for what, given, kind in (("params", params, "Param"), ("args", args, "Arg")):
        if isinstance(given, (Param, Arg, str)):  # (Param("N", "int")) without its comma
            raise TypeError(f"kernel {name}: {what} must be a tuple of {kind}s, got {given!r}")
    params, args = tuple(params), tuple(args)

    def declare(function: Callable) -> KernelDef:
        if "." in function.__qualname__:
            raise ValueError(
                f"{function.__qualname__}: a kernel's builder must be a module-level function"
            )
        from ..cache.sources import fingerprint

        builder = f"{_module_name(function)}:{function.__qualname__}"
        # The source as this process runs it: its file read now, not at the first compile.
        source = fingerprint(builder, function.__code__.co_filename)
        definition = KernelDef(name, builder, params, args, tunable, function, source)
        return register(definition)

    return declare
