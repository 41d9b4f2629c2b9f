"""Instance-level patches: a new `forward` bound to one module object (types.MethodType in its
__dict__), so other instances of the class, in this model or another, keep the class's.

`nn.Module.__call__` looks `forward` up on the instance, so hooks still fire around it, and
`copy.deepcopy` rebinds it to the copy. A module that already has an instance-level forward
(accelerate's device hooks put one there) is refused: replacing it would drop that wrapper.
"""

from __future__ import annotations

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
    """A copy of `fn` whose global names in `replace` resolve to the given objects: the other
    globals are a snapshot of fn's module taken now. The code object is copied too, since
    torch.compile caches its transformed code per code object, and one code object run under
    two globals dicts would replay the first one's compiled frame in the second."""
    scope = dict(fn.__globals__)
    scope.update(replace)
    new = types.FunctionType(
        fn.__code__.replace(), scope, fn.__name__, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__dict__.update(fn.__dict__)
    return new
