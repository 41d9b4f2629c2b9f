"""Per-row timestamps of a persistent row loop, a diagnostic build (`trace=True` in the row
kernel builders; bench/trace_rows.py reads them): where one row step of a block spends its
time. NVIDIA only (the SM cycle counter and the global nanosecond timer, inline PTX).

Thread 0 of each block stores, for each of its first TRACE_ITERATIONS row steps, the SM's cycle
counter at five points of the step and the global timer at its start:

    0 step start      1 row landed (staged rows)    2 block reduction done
    3 cluster exchange done                         4 step end (stores issued)
    5 global timer (ns) at the step start

into the kernel argument `trace`, an int64 array of [grid, iterations, 6] (zero where a point
was not passed). Points a step does not pass (no cluster, no staging) stay 0. The layout is
kbuild/trace_layout.py, which the readers import without MLIR.
"""

from __future__ import annotations

from ..trace_layout import TRACE_ITERATIONS, TRACE_WORDS
from ..trace_layout import TRACE_POINTS as POINTS
from .control import if_then
from .memory import get_llvm_ptr, store
from .values import V, inline_asm, scalar_type


def _clock(machine):
    """The interpreter's timer: the machine's count of steps (a GPU timer only grows)."""
    return [machine.ticks()]


def _read(register: str) -> V:
    text = f"mov.u64 $0, %{register};"
    return V(inline_asm(text, "=l", [], scalar_type("i64"), meaning=_clock))


class Trace:
    def __init__(self, k):
        if k.target.vendor != "nvidia":
            raise ValueError(f"trace reads NVIDIA timers; {k.target} has none")
        self.k = k
        self.ptr = k.ptr("trace")
        self.iteration: V | None = None  # the current row step (i64), set by the row loop

    def mark(self, point: str) -> None:
        """Record `point` of the current row step (nothing outside a traced row loop)."""
        if self.iteration is None:
            return
        k, step = self.k, self.iteration
        index = POINTS.index(point)

        def record() -> None:
            base = (k.block_id() * TRACE_ITERATIONS + step) * TRACE_WORDS
            store(_read("clock64"), get_llvm_ptr(self.ptr, base + index, "i64"))
            if index == 0:
                store(_read("globaltimer"), get_llvm_ptr(self.ptr, base + len(POINTS), "i64"))

        if_then((k.thread_id() < 1) & (step < TRACE_ITERATIONS), record)
