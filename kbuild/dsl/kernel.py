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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import gpu, llvm, nvvm

from ..targets import Target
from .control import loop
from .exchange import ClusterExchange
from .memory import get_llvm_ptr
from .values import V, cast, const, element_bytes, scalar_type

GLOBAL = 1
SHARED = 3
SHARED_CLUSTER = 7  # another block's shared memory, within a cluster


def global_ptr_type() -> ir.Type:
    return llvm.PointerType.get(address_space=GLOBAL)


def _dimension(dim: str) -> gpu.Dimension:
    if dim not in ("x", "y", "z"):
        raise ValueError(f"a grid dimension is 'x', 'y' or 'z', not {dim!r}")
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
        if exc_type is None:
            gpu.ReturnOp([])
        self._ip.__exit__(exc_type, exc, tb)
        if exc_type is None:
            types = [a.type for a in self._entry.arguments]
            self._fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(types, []))
        self.location.__exit__(exc_type, exc, tb)
        self.context.__exit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ arguments

    def _arg(self, name: str, kind: str, t: ir.Type) -> V:
        self.args.append((name, kind))
        return V(self._entry.add_argument(t, self.location))

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
        return cast(V(gpu.block_id(_dimension(dim))), "i64")

    def grid_size(self, dim: str = "x") -> V:
        """Blocks in the grid along `dim`."""
        return cast(V(gpu.grid_dim(_dimension(dim))), "i64")

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
        name = f"__smem{self._n_shared}"
        self._n_shared += 1
        elem = scalar_type(dtype)
        text = (
            f"llvm.mlir.global internal @{name}() {{addr_space = 3 : i32, alignment = 16 : i64}}"
            f" : !llvm.array<{count} x {elem}>"
        )
        op = ir.Operation.parse(text)
        self._module_ip.insert(op)
        self._shared_bytes += count * (elem.width // 8)
        self._check_shared()
        return name

    def shared_address(self, name: str) -> V:
        """The base of the shared array `name`, taken at the current insertion point."""
        ptr_t = llvm.PointerType.get(address_space=SHARED)
        return V(llvm.AddressOfOp(ptr_t, name).result)

    def dynamic_shared(self, count: int, dtype: str = "f32") -> V:
        """A shared array sized at launch (`meta["dynamic_shared_bytes"]`, which the launcher
        passes): unlike `shared`, together they may exceed the 48 KB a kernel can declare
        statically. Each call takes the next 16-byte aligned span of one extern array."""
        ptr_t = llvm.PointerType.get(address_space=SHARED)
        if "dynamic_shared_bytes" not in self.meta:
            text = (
                "llvm.mlir.global external @__dynamic_smem() {addr_space = 3 : i32, "
                "alignment = 16 : i64} : !llvm.array<0 x i8>"
            )
            self._module_ip.insert(ir.Operation.parse(text))
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
