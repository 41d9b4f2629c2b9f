"""What each piece of inline asm the DSL emits computes, for the interpreter (kbuild.interpret).

Inline PTX is opaque to MLIR, so the helper that emits a template registers its meaning beside
it: `register(text, meaning)`, where `meaning(machine, *operands)` takes the operands as numpy
arrays (one entry per thread; the machine's `mask` says which threads run) and returns the
results' arrays (or None). Machine methods give the state the asm acts on (mbarriers, a
peer's shared memory). No MLIR or numpy here: registering costs a dict entry.
"""

from __future__ import annotations

from collections.abc import Callable

_MEANINGS: dict[str, Callable] = {}


def register(text: str, meaning: Callable) -> None:
    _MEANINGS[text] = meaning


def lookup(text: str) -> Callable | None:
    return _MEANINGS.get(text)
