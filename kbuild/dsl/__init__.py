"""kbuild's kernel DSL: readable helpers over the upstream MLIR Python bindings.

The row layer (rows.py: `RowTile`, `GroupedRows`; row_walk.py: `RowGroups`; staging.py:
`RowStage`; shared.py: `ThreadShared`) is what every row kernel (norms, softmax,
cross-entropy) is written with; `Kernel.grid_stride` walks the items of an
elementwise kernel.

Target-neutral: the warp size and the gpu.module target attribute come from the Target; no
helper here branches on the vendor. Importing this package imports MLIR, so only the
compiler and the kernel builders do.

Misuse (operands of different types, a bad dtype or width, branches or loop bodies that
change a value's type) raises a TypeError / ValueError naming the function and the operand
types before MLIR sees it; every op built in a `Kernel` carries the builder's file:line as
its location, so IR that still fails to verify (`Kernel.verify`, a `VerifyError`) names the
line that emitted it.
"""

from .checks import report, trap
from .control import if_else, if_then, loop, while_loop
from .kernel import Kernel, VerifyError
from .math import absolute, copysign, erf, exp, exp2, log, log2, sigmoid, tanh
from .memory import (
    atomic_add,
    commit_async,
    copy_async,
    get_llvm_ptr,
    load,
    prefetch_l2,
    store,
    wait_async,
)
from .reduce import (
    add,
    first_largest,
    group_reduce,
    largest,
    row_reduce,
    softmax_pair,
    thread_max,
    thread_sum,
)
from .row_walk import RowGroups
from .rows import (
    GroupedRows,
    RowShape,
    RowTile,
    from_lanes,
    lanes,
    rewiden_all,
    thread_columns,
    widen,
)
from .shared import ThreadShared
from .staging import RowStage, Staged
from .trig import cos, sin, sincos
from .values import (
    NEG_INF,
    POS_INF,
    V,
    cast,
    const,
    dot,
    element_bytes,
    eq,
    fma,
    hsum,
    i32,
    i64,
    join,
    maximum,
    minimum,
    ne,
    opaque,
    rewiden,
    rsqrt,
    select,
    splat,
    split,
    to_f32,
)

__all__ = [
    "GroupedRows",
    "Kernel",
    "NEG_INF",
    "POS_INF",
    "RowGroups",
    "RowShape",
    "RowStage",
    "RowTile",
    "Staged",
    "ThreadShared",
    "V",
    "VerifyError",
    "absolute",
    "atomic_add",
    "report",
    "trap",
    "lanes",
    "from_lanes",
    "add",
    "first_largest",
    "largest",
    "softmax_pair",
    "thread_max",
    "thread_sum",
    "cast",
    "commit_async",
    "copy_async",
    "copysign",
    "cos",
    "const",
    "dot",
    "element_bytes",
    "eq",
    "erf",
    "exp",
    "exp2",
    "fma",
    "get_llvm_ptr",
    "group_reduce",
    "hsum",
    "i32",
    "i64",
    "if_else",
    "if_then",
    "join",
    "load",
    "log",
    "log2",
    "loop",
    "maximum",
    "minimum",
    "ne",
    "opaque",
    "prefetch_l2",
    "rewiden",
    "rewiden_all",
    "row_reduce",
    "rsqrt",
    "select",
    "sigmoid",
    "sin",
    "sincos",
    "split",
    "splat",
    "store",
    "thread_columns",
    "tanh",
    "to_f32",
    "wait_async",
    "while_loop",
    "widen",
]
