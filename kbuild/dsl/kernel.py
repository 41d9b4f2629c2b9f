"""Kernel: the module, gpu.module and gpu.func around a kernel body, plus its arguments.

    with Kernel("rmsnorm_fwd", target, block=256) as k:
        x, y = k.ptr("x"), k.ptr("y")
        rows = k.i64("M")
        ...
    module = k.module

Arguments are raw global pointers (`!llvm.ptr<1>`) and i64/f32 scalars, in declaration order;
`k.signature` records them for the launcher. The block size is a compile-time constant
(`known_block_size`), which also means AMD code never asks the device library for it.
Blocks are one-dimensional; grids may have y and z (`block_id("y")`; the launcher takes a
grid as a count or as (x, y, z) counts: runtime/prepared.py). `grid_stride` walks the items
of an elementwise kernel.

Locations: while a Kernel is open, every op built without an explicit location gets the
builder's line (the innermost Python frame outside kbuild/dsl and MLIR's own package, as
`"build_x"("/path/builder.py":42:8 to :30)`), so a verifier error names the line that emitted
the op (`Kernel.verify`). Locations reach no binary: without debug-info scopes the lowering
emits no line info, and the printed IR (`str(module)`) leaves them out.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import gpu, llvm, nvvm

from ..targets import Target
from .control import loop
from .exchange import ClusterExchange
from .memory import get_llvm_ptr, need_pointer
from .values import (
    V,
    cast,
    const,
    dtype_name,
    element_bytes,
    need_int,
    need_int_scalar,
    scalar_type,
)

GLOBAL = 1
SHARED = 3
SHARED_CLUSTER = 7  # another block's shared memory, within a cluster


def global_ptr_type() -> ir.Type:
    return llvm.PointerType.get(address_space=GLOBAL)


# The kernel author's frames are those outside this package and MLIR's Python bindings.
_INSIDE_DIRS = {
    path(d)
    for d in (os.path.dirname(__file__), os.path.dirname(ir.__file__))
    for path in (os.path.abspath, os.path.realpath)
}
_INSIDE = tuple(os.path.join(d, "") for d in sorted(_INSIDE_DIRS))


@functools.cache
def _outside(filename: str) -> bool:
    """Whether a frame of `filename` is the kernel author's: outside this package and MLIR."""
    return not os.path.abspath(filename).startswith(_INSIDE)


class _BuilderLocations:
    """MLIR's traceback locations (`ir.loc_tracebacks`), on while any Kernel is open: each op
    created without an explicit location is given the innermost frame that is neither in
    this package nor in MLIR's bindings (a frame walk in C++, under a microsecond an op).
    The setting is global to the process, so open kernels are counted (threads may build
    kernels at once) and the setting found before the first is restored after the last."""

    _lock = threading.Lock()
    _open = 0
    _saved: tuple[bool, int] | None = None

    @classmethod
    def _globals(cls):
        from mlir._mlir_libs import _mlir

        g = getattr(_mlir, "globals", None)
        return g if hasattr(g, "set_loc_tracebacks_enabled") else None

    @classmethod
    def exclude(cls) -> None:
        g = cls._globals()
        if g is None:
            return
        for prefix in _INSIDE:
            g.register_traceback_file_exclusion(prefix)

    @classmethod
    def enter(cls) -> None:
        g = cls._globals()
        if g is None:
            return
        with cls._lock:
            if cls._open == 0:
                cls._saved = (g.loc_tracebacks_enabled(), g.loc_tracebacks_frame_limit())
                g.set_loc_tracebacks_frame_limit(1)
                g.set_loc_tracebacks_enabled(True)
            cls._open += 1

    @classmethod
    def exit(cls) -> None:
        g = cls._globals()
        if g is None:
            return
        with cls._lock:
            cls._open -= 1
            if cls._open == 0 and cls._saved is not None:
                enabled, limit = cls._saved
                g.set_loc_tracebacks_enabled(enabled)
                g.set_loc_tracebacks_frame_limit(limit)


_BuilderLocations.exclude()


def where(location: ir.Location) -> str:
    """A location as "file:line (function)" (a location without a file: as MLIR prints it)."""
    try:
        name = None
        for _ in range(16):
            if location.is_a_name():
                name = location.name_str
                location = location.child_loc
            elif location.is_a_callsite():
                location = location.callee
            elif location.is_a_fused() and location.locations:
                location = location.locations[0]
            else:
                break
        if location.is_a_file():
            text = f"{location.filename}:{location.start_line}"
            return f"{text} ({name})" if name and name != "<module>" else text
    except Exception:  # a location kind the bindings cannot take apart
        pass
    return str(location)


def describe_mlir_error(err: Exception) -> str:
    """An MLIRError's diagnostics, one per line, each with the builder's file:line."""
    diagnostics = getattr(err, "error_diagnostics", None)
    if not diagnostics:
        return str(err)
    lines = []
    for d in diagnostics:
        lines.append(f"{where(d.location)}: {d.message}")
        for note in d.notes:
            text = note.message.replace("\n", " ")
            lines.append(f"  note: {text if len(text) < 300 else text[:300] + '...'}")
    return "\n".join(lines)


def builder_line(err: BaseException) -> str | None:
    """Where a builder raised `err`: "file:line" of the innermost frame of its traceback
    outside this package and MLIR's bindings (None if every frame is inside)."""
    found, tb = None, err.__traceback__
    while tb is not None:
        if _outside(tb.tb_frame.f_code.co_filename):
            found = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def caller_location() -> ir.Location | None:
    """The builder's line as a location, for ops made without the op builders (parsed text,
    block arguments): the innermost frame outside this package and MLIR."""
    frame = sys._getframe(1)
    while frame is not None and not _outside(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    return ir.Location.name(code.co_name, ir.Location.file(code.co_filename, frame.f_lineno, 0))


class VerifyError(ValueError):
    """A kernel's IR does not verify: the message names the kernel and, per error, the
    builder's file:line that emitted the failing op."""


def _dimension(dim: str, fn: str) -> gpu.Dimension:
    if not isinstance(dim, str) or dim not in ("x", "y", "z"):
        raise ValueError(f"{fn}: a grid dimension is 'x', 'y' or 'z', not {dim!r}")
    return getattr(gpu.Dimension, dim)


class Kernel:
    def __init__(
        self,
        name: str,
        target: Target,
        block: int,
        min_blocks_per_sm: int | None = None,
        cluster: int = 1,
        exchange: str = "barrier",
    ):
        """`min_blocks_per_sm` asks the backend to fit that many blocks on a multiprocessor
        (on NVIDIA, `.minnctapersm`: registers are capped to make room). `cluster` > 1 groups
        that many consecutive blocks into a cluster (see `remote`, `cluster_arrive`); the
        grid must then be a multiple of it. `exchange`: how row states cross the cluster,
        "barrier" or "mbarrier" (the kernel's `exchange`, a dsl.exchange.ClusterExchange)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"Kernel: name must be a non-empty string, got {name!r}")
        block = need_int(block, "Kernel", "block")
        cluster = need_int(cluster, "Kernel", "cluster")
        target.cluster_attribute(cluster)  # an unsupported cluster size raises here, early
        self.name = name
        self.min_blocks_per_sm = min_blocks_per_sm
        self.cluster = cluster
        self._exchange = ClusterExchange(self, exchange)
        self.trace = None  # a dsl.trace.Trace in a diagnostic build: row loops mark their steps
        self.target = target
        self.block = block
        self.args: list[tuple[str, str]] = []  # (name, "ptr" | "i64" | "f32")
        self._shared_bytes = 0
        self._n_shared = 0
        self.meta: dict[str, object] = {}  # launch facts for the runtime (rows_per_block, ...)
        self.context = ir.Context()
        self.location = ir.Location.unknown(self.context)

    # Arguments are declared lazily: the body asks for them in order, and the function type is
    # fixed when the body ends (see __exit__), so a builder never writes its signature twice.
    def __enter__(self) -> Kernel:
        self.context.__enter__()
        self.location.__enter__()
        _BuilderLocations.enter()
        self.module = ir.Module.create()
        self.module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(self.module.body):
            targets = ir.ArrayAttr.get([ir.Attribute.parse(self.target.mlir_attr)])
            self.gpu_module = gpu.GPUModuleOp(self.name + "_module", targets=targets)
            self.gpu_module.bodyRegion.blocks.append()
        self._module_ip = ir.InsertionPoint(self.gpu_module.bodyRegion.blocks[0])
        try:
            self._begin_function()
        except BaseException as err:  # leave MLIR's context stack as it was
            _BuilderLocations.exit()
            self.location.__exit__(type(err), err, err.__traceback__)
            self.context.__exit__(type(err), err, err.__traceback__)
            raise
        return self

    def _begin_function(self) -> None:
        # A placeholder function with no arguments; real arguments are added as the body asks
        # for them (Block.add_argument) and the function type is rewritten at the end.
        with self._module_ip:
            fn_type = ir.FunctionType.get([], [])
            self._fn = gpu.GPUFuncOp(
                ir.TypeAttr.get(fn_type),
                sym_name=self.name,
                kernel=True,
                known_block_size=[self.block, 1, 1],
            )
            hints = (
                self.target.occupancy_attribute(self.min_blocks_per_sm),
                self.target.cluster_attribute(self.cluster),
            )
            for hint in hints:
                if hint is not None:
                    self._fn.attributes[hint[0]] = ir.Attribute.parse(hint[1])
            self._entry = self._fn.body.blocks.append()
        self._ip = ir.InsertionPoint(self._entry)
        self._ip.__enter__()
        self._cluster_started = self.cluster == 1
        if not self._cluster_started:
            # Distributed shared memory is only valid once every block of the cluster runs:
            # each block arrives here, and waits (`ensure_cluster_started`) before its first
            # store into another block, so the wait overlaps whatever comes between.
            self._entry_arrive = nvvm.cluster_arrive_relaxed(aligned=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                gpu.ReturnOp([])
            self._ip.__exit__(exc_type, exc, tb)
            if exc_type is None:
                types = [a.type for a in self._entry.arguments]
                fn_type = ir.FunctionType.get(types, [])
                self._fn.attributes["function_type"] = ir.TypeAttr.get(fn_type)
        finally:
            _BuilderLocations.exit()
            self.location.__exit__(exc_type, exc, tb)
            self.context.__exit__(exc_type, exc, tb)

    def verify(self) -> None:
        """Run MLIR's verifier over the module; failing ops raise a VerifyError that names
        this kernel and the builder's file:line of each."""
        with self.context:
            try:
                self.module.operation.verify()
            except ir.MLIRError as err:
                raise VerifyError(
                    f"kernel {self.name}: IR does not verify:\n{describe_mlir_error(err)}"
                ) from None

    # ------------------------------------------------------------------ arguments

    def _arg(self, name: str, kind: str, t: ir.Type) -> V:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Kernel.{kind}: an argument's name is a string, got {name!r}")
        if any(name == n for n, _ in self.args):
            raise ValueError(f"Kernel.{kind}: argument {name!r} is declared twice")
        self.args.append((name, kind))
        return V(self._entry.add_argument(t, caller_location() or self.location))

    def ptr(self, name: str) -> V:
        """A global-memory pointer argument (a tensor's data_ptr)."""
        return self._arg(name, "ptr", global_ptr_type())

    def i64(self, name: str) -> V:
        return self._arg(name, "i64", scalar_type("i64"))

    def f32(self, name: str) -> V:
        return self._arg(name, "f32", scalar_type("f32"))

    # ------------------------------------------------------------------ ids and sync

    def thread_id(self) -> V:
        """This thread's index in its block (blocks are one-dimensional: `block` threads)."""
        return cast(V(gpu.thread_id(gpu.Dimension.x)), "i64")

    def block_id(self, dim: str = "x") -> V:
        """This block's index in the grid along `dim` ("x", "y" or "z"): a grid of rows or
        items in x, and, say, one y per tensor of a batch."""
        return cast(V(gpu.block_id(_dimension(dim, "Kernel.block_id"))), "i64")

    def grid_size(self, dim: str = "x") -> V:
        """Blocks in the grid along `dim`."""
        return cast(V(gpu.grid_dim(_dimension(dim, "Kernel.grid_size"))), "i64")

    def grid_stride(
        self, n: V | int, body: Callable[[V, list[V]], Sequence[V]], carried: Sequence[V] = ()
    ) -> list[V]:
        """The elementwise walk: each thread takes items i = its global index (block_id("x")
        * block + thread_id), then i + the grid's threads, ... while i < n (i64), so any grid
        covers any n, a grid of one wave of resident blocks included. `body(i, carried) -> new
        carried` (see dsl.loop); returns the carried values after this thread's last item.
        Consecutive threads take consecutive items: an item of 16 bytes (a vector) keeps a
        warp's accesses whole sectors."""
        start = self.block_id() * self.block + self.thread_id()
        step = self.grid_size() * self.block
        if not isinstance(n, int):
            need_int_scalar(n, "Kernel.grid_stride", "n")
        stop = const(n, "i64") if isinstance(n, int) else n
        return loop(start, stop, step, carried, body)

    def barrier(self) -> None:
        gpu.barrier()

    # ------------------------------------------------------------------ clusters

    @property
    def exchange(self) -> ClusterExchange:
        """How the blocks of a cluster exchange row states (dsl.exchange; fixed at creation)."""
        return self._exchange

    def cluster_rank(self) -> V:
        """This block's index within its cluster (i64; 0 without clusters)."""
        if self.cluster == 1:
            return const(0, "i64")
        rank = nvvm.read_ptx_sreg_cluster_ctarank(ir.IntegerType.get_signless(32))
        return cast(V(rank), "i64")

    def remote(self, shared_ptr: V, rank: V) -> V:
        """The same shared-memory address in block `rank` of this cluster (store to it)."""
        need_pointer(shared_ptr, "Kernel.remote", "shared_ptr", space=SHARED)
        need_int_scalar(rank, "Kernel.remote", "rank")
        ptr_t = llvm.PointerType.get(address_space=SHARED_CLUSTER)
        return V(nvvm.mapa(ptr_t, shared_ptr.value, cast(rank, "i32").value))

    def cluster_arrive(self) -> None:
        """Cluster barrier, first half: every thread of every block arrives (release)...
        Work placed before `cluster_wait` overlaps the wait for the other blocks."""
        nvvm.cluster_arrive(aligned=True)

    def cluster_wait(self) -> None:
        """...and waits (acquire): shared-memory stores made before the arrive, local or
        remote, are visible after it."""
        nvvm.cluster_wait(aligned=True)

    def at_cluster_start(self) -> ir.InsertionPoint:
        """Where code runs once per block before it announces it has started (with clusters):
        set-up that other blocks of the cluster rely on, such as mbarrier initialisation.
        Use as `with k.at_cluster_start(): ...`; values made inside stay inside."""
        if self.cluster == 1:
            raise ValueError("at_cluster_start needs a kernel with clusters")
        return ir.InsertionPoint(self._entry_arrive)

    def ensure_cluster_started(self) -> None:
        """Wait until every block of the cluster has started (pairs with the arrive at kernel
        entry); emitted once, at the first call. Call it outside loops: `remote` stores need
        it, and a kernel whose first remote store sits in a loop calls it before the loop."""
        if not self._cluster_started:
            self._cluster_started = True
            self.cluster_wait()

    @property
    def warp_size(self) -> int:
        return self.target.warp_size

    # ------------------------------------------------------------------ shared memory

    def shared(self, count: int, dtype: str = "f32") -> V:
        """A fresh shared-memory array of `count` elements; returns its `!llvm.ptr<3>` base."""
        return self.shared_address(self.shared_array(count, dtype))

    def shared_array(self, count: int, dtype: str = "f32") -> str:
        """Declare a fresh shared-memory array; returns its name (see `shared_address`)."""
        dtype_name(dtype, "Kernel.shared_array", ("f32", "f16", "bf16", "i8", "i32", "i64"))
        count = need_int(count, "Kernel.shared_array", "count")
        name = f"__smem{self._n_shared}"
        self._n_shared += 1
        elem = scalar_type(dtype)
        text = (
            f"llvm.mlir.global internal @{name}() {{addr_space = 3 : i32, alignment = 16 : i64}}"
            f" : !llvm.array<{count} x {elem}>"
        )
        self._shared_bytes += count * (elem.width // 8)
        self._check_shared()
        self._module_ip.insert(self._parse(text))
        return name

    @staticmethod
    def _parse(text: str) -> ir.Operation:
        """An op from its text, located at the builder's line like the others."""
        loc = caller_location()
        return ir.Operation.parse(text if loc is None else f"{text} {loc}")

    def shared_address(self, name: str) -> V:
        """The base of the shared array `name`, taken at the current insertion point."""
        ptr_t = llvm.PointerType.get(address_space=SHARED)
        return V(llvm.AddressOfOp(ptr_t, name).result)

    def dynamic_shared(self, count: int, dtype: str = "f32") -> V:
        """A shared array sized at launch (`meta["dynamic_shared_bytes"]`, which the launcher
        passes): unlike `shared`, together they may exceed the 48 KB a kernel can declare
        statically. Each call takes the next 16-byte aligned span of one extern array."""
        dtype_name(dtype, "Kernel.dynamic_shared", ("f32", "f16", "bf16", "i8", "i32", "i64"))
        count = need_int(count, "Kernel.dynamic_shared", "count")
        ptr_t = llvm.PointerType.get(address_space=SHARED)
        if "dynamic_shared_bytes" not in self.meta:
            text = (
                "llvm.mlir.global external @__dynamic_smem() {addr_space = 3 : i32, "
                "alignment = 16 : i64} : !llvm.array<0 x i8>"
            )
            self._module_ip.insert(self._parse(text))
            self.meta["dynamic_shared_bytes"] = 0
        offset = self.meta["dynamic_shared_bytes"]
        self.meta["dynamic_shared_bytes"] = offset + -(-count * element_bytes(dtype) // 16) * 16
        self._check_shared()
        base = V(llvm.AddressOfOp(ptr_t, "__dynamic_smem").result)
        return base if offset == 0 else get_llvm_ptr(base, offset, "i8")

    def _check_shared(self) -> None:
        total = self._shared_bytes + self.meta.get("dynamic_shared_bytes", 0)
        if total > self.target.shared_bytes_per_block:
            raise ValueError(
                f"{self.name} needs {total} bytes of shared memory per block; "
                f"{self.target.arch} allows {self.target.shared_bytes_per_block}"
            )

    @property
    def shared_bytes(self) -> int:
        """Static shared memory (dynamic: `meta["dynamic_shared_bytes"]`)."""
        return self._shared_bytes

    def signature(self) -> list[tuple[str, str]]:
        return list(self.args)
