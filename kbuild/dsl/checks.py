"""Device-side checks: what a kernel does with data it cannot use (a target id outside the
vocabulary, say) instead of reading past an array.

`report` writes an error code into a flag the op allocated (an int32, zero before the launch)
and lets the kernel go on with a safe value: the op reads the flag after the launch and
raises a Python error naming the bad input. Reading it waits for the kernel, so an op that
must not synchronise reads it later (or only under a debug switch) and says so.
`trap` stops the kernel at once; the CUDA context is then lost for the whole process, so
it is for debugging, not for errors a user can make.
"""

from __future__ import annotations

from mlir.dialects import llvm

from .control import if_then
from .memory import need_pointer
from .values import V, const, need_flag


def report(flag: V, bad: V, code: int = 1) -> None:
    """Where `bad` (i1) holds, raise the int32 at `flag` to `code` (a positive number naming
    the error): an atomic max, so threads reporting at once leave the largest code and a
    flag shared by several launches keeps the worst. Nothing is written where all is well."""
    if not isinstance(code, int) or isinstance(code, bool) or not 1 <= code < 2**31:
        raise ValueError(f"dsl.report: code must be a positive int32, not {code!r}")
    need_pointer(flag, "dsl.report", "flag")
    need_flag(bad, "dsl.report", "bad")
    value = const(code, "i32")
    if_then(
        bad,
        lambda: llvm.AtomicRMWOp(
            llvm.AtomicBinOp.max, flag.value, value.value, llvm.AtomicOrdering.monotonic
        ),
    )


def trap(bad: V) -> None:
    """Where `bad` (i1) holds, stop the kernel (PTX `trap`): the launch fails with an
    illegal-instruction error and the process's CUDA context is unusable after it."""
    need_flag(bad, "dsl.trap", "bad")
    if_then(bad, lambda: llvm.Trap())
