"""Instance-level patches: a new `forward` bound to one module object (types.MethodType in its
__dict__), so other instances of the class, in this model or another, keep the class's.

`nn.Module.__call__` looks `forward` up on the instance, so hooks still fire around it, and
`copy.deepcopy` rebinds it to the copy. A module that already has an instance-level forward
(accelerate's device hooks put one there) is refused: replacing it would drop that wrapper.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

MARK = "_kbuild_patch"  # set on every function kbuild binds: what it computes


def refusal(module: torch.nn.Module) -> str | None:
    """Why `module`'s forward cannot be replaced, or None."""
    own = module.__dict__.get("forward")
    if own is None:
        return None
    tag = getattr(getattr(own, "__func__", own), MARK, None)
    if tag is not None:
        return f"already patched by kbuild ({tag})"
    return "has an instance-level forward already (e.g. accelerate hooks): left to it"


def bind(module: torch.nn.Module, fn: Callable, tag: str) -> Callable[[], None]:
    """Bind fn(self, ...) as `module.forward`; returns the undo."""
    setattr(fn, MARK, tag)
    module.forward = types.MethodType(fn, module)

    def undo() -> None:
        if getattr(module.__dict__.get("forward"), "__func__", None) is fn:
            del module.__dict__["forward"]

    return undo


def with_globals(fn: types.FunctionType, replace: dict[str, object]) -> types.FunctionType:
    """A copy of `fn` whose global names in `replace` resolve to the given objects, the others
    to a snapshot of fn's module taken the first time (`_shadow`).

    The code object is copied too: torch.compile caches its transformed code per code object,
    and one code object run under two globals would replay one's compiled frame in the other."""
    scope = _shadow(fn.__globals__, replace).__dict__
    new = types.FunctionType(
        fn.__code__.replace(), scope, fn.__name__, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


def rewrapped(outer: Callable, new_inner: types.FunctionType) -> Callable | str:
    """`outer` (a function, possibly wrapped by decorators that keep what they wrap in a closure
    cell and name it `__wrapped__`, as functools.wraps does: transformers' deprecate_kwarg,
    can_return_tuple) with its innermost function replaced by `new_inner`, every wrapper copied
    around it with that one cell changed, so the decorators still run. Returns why not where a
    layer is no plain function or does not hold the next one in a cell."""
    chain = [outer]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    new = new_inner
    for layer, below in zip(reversed(chain[:-1]), reversed(chain[1:]), strict=True):
        cells = layer.__closure__ if isinstance(layer, types.FunctionType) else None
        if not cells or not any(_holds(c, below) for c in cells):
            name = getattr(layer, "__qualname__", type(layer).__name__)
            return f"its class's forward is wrapped by {name}, which holds it in no closure cell"
        closure = tuple(types.CellType(new) if _holds(c, below) else c for c in cells)
        copy = types.FunctionType(
            layer.__code__, layer.__globals__, layer.__name__, layer.__defaults__, closure
        )
        copy.__kwdefaults__ = layer.__kwdefaults__
        copy.__dict__.update(layer.__dict__)
        copy.__qualname__, copy.__doc__, copy.__wrapped__ = layer.__qualname__, layer.__doc__, new
        new = copy
    return new


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


_SHADOWS: dict[tuple, types.ModuleType] = {}


def _shadow(scope: dict, replace: dict[str, object]) -> types.ModuleType:
    """A module holding a copy of `scope` with `replace` applied, registered in sys.modules
    under its own name: torch.compile reaches the globals of a function it inlines through
    sys.modules[fn.__globals__["__name__"]], so a bare dict named as the original module would
    be read (and guarded) as the original. One per (module, replacements) in the process."""
    source = scope.get("__name__", "unnamed")
    key = (source, tuple((name, id(value)) for name, value in sorted(replace.items())))
    if key not in _SHADOWS:
        name = f"kbuild.nn.patching.shadow{len(_SHADOWS)}.{source}"
        module = types.ModuleType(name)
        hidden = ("__name__", "__spec__", "__loader__", "__package__", "__builtins__")
        module.__dict__.update({k: v for k, v in scope.items() if k not in hidden})
        module.__dict__.update(replace)
        module.__builtins__ = scope.get("__builtins__", __builtins__)
        sys.modules[name] = module
        _SHADOWS[key] = module
    return _SHADOWS[key]
