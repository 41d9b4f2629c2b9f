"""One launch on the interpreter: the grid cut into chunks of whole clusters, each chunk's
threads run as numpy lanes in lockstep.

Lane i of a chunk is thread i % block of the chunk's block i // block; a warp is 32 (NVIDIA)
or 64 (AMD) consecutive threads of a block; a cluster is `cluster` consecutive blocks in x.
"""

from __future__ import annotations

import os

import numpy as np

from . import threads
from .memory import ALLOCATIONS, KernelFault, RaceError, SharedMemory, split_cluster_address
from .program import Program
from .regions import run_region
from .types import splat

LANES_PER_CHUNK = 1 << 15


class Machine:
    """The state of one chunk of blocks: SSA values, the active mask, the memories."""

    def __init__(
        self,
        program: Program,
        grid: tuple[int, int, int],
        first_block: int,
        blocks: int,
        warp_size: int,
        dynamic_shared: int,
        gmem,
    ) -> None:
        self.program = program
        self.kernel = program.name
        self.grid = grid
        self.block = program.block
        self.warp_size = warp_size
        self.cluster = program.cluster
        self.blocks = blocks
        self.first_block = first_block
        self.lanes = n = blocks * self.block
        lane = np.arange(n, dtype=np.int64)
        self.tid = lane % self.block
        self.local_block = lane // self.block
        linear = first_block + self.local_block
        gx, gy, _ = grid
        self.bid = (linear % gx, (linear // gx) % gy, linear // (gx * gy))
        self.rank = self.bid[0] % self.cluster
        self.vals: list = [None] * program.nslots
        self.mask = np.ones(n, bool)
        self.gmem = gmem
        shared = program.static_shared
        self.dynamic_base = -(-shared // 16) * 16
        size = self.dynamic_base + dynamic_shared
        check = os.environ.get("KBUILD_INTERPRET_RACES", "1") != "0"
        self.smem = SharedMemory(blocks, size, check)
        self._ticks = 0

    # -- naming threads in errors -----------------------------------------------------

    def who(self, lane: int) -> str:
        b = tuple(int(a[lane]) for a in self.bid)
        return f"block ({b[0]}, {b[1]}, {b[2]}) thread ({int(self.tid[lane])}, 0, 0)"

    def fault(self, what: str, lane: int) -> KernelFault:
        return KernelFault(f"{self.kernel}: {what} by {self.who(lane)}")

    # -- shared addresses ---------------------------------------------------------------

    def shared_flat(self, lanes: np.ndarray, addr: np.ndarray, size: int, what: str, remote):
        """Flat byte index of each lane's shared access and the block that owns it."""
        owner = self.local_block[lanes].copy()
        offset = addr.copy()
        if remote:
            rank, offset = split_cluster_address(addr)
            bad = (rank < 0) | (rank >= self.cluster)
            if bad.any():
                i = int(np.argmax(bad))
                raise self.fault(
                    f"{what} at distributed shared address {int(addr[i]):#x} names no block of "
                    f"its cluster of {self.cluster}",
                    int(lanes[i]),
                )
            owner = owner - self.rank[lanes] + rank
        bad = (offset < 0) | (offset + size > self.smem.size)
        if bad.any():
            i = int(np.argmax(bad))
            raise self.fault(
                f"out-of-bounds {what} of {size} bytes at shared address {int(offset[i]):#x} "
                f"(the block has {self.smem.size} bytes of shared memory)",
                int(lanes[i]),
            )
        return owner * self.smem.bytes.shape[1] + offset, owner

    def check_race(self, lanes, flat, size, owner, write: bool) -> None:
        sm = self.smem
        if not sm.check:
            return
        actor = self.local_block[lanes] * self.block + self.tid[lanes]
        first = flat // 4
        last = (flat + size - 1) // 4
        for k in range(int((last - first).max()) + 1):
            words = np.minimum(first + k, last)
            epoch = sm.epoch[owner]
            if write:
                prior = sm.writer[words]
                clash = (prior >= 0) & (prior != actor) & (sm.wepoch[words] == epoch)
                readers = sm.reader[words]
                clash |= (readers != -1) & (readers != actor) & (sm.repoch[words] == epoch)
                if clash.any():
                    i = int(np.argmax(clash))
                    other = int(prior[i]) if prior[i] >= 0 and prior[i] != actor[i] else None
                    self._race(lanes[i], words[i], other, "writes", readers[i])
                sm.writer[words] = actor
                sm.wepoch[words] = epoch
            else:
                prior = sm.writer[words]
                clash = (prior >= 0) & (prior != actor) & (sm.wepoch[words] == epoch)
                if clash.any():
                    i = int(np.argmax(clash))
                    self._race(lanes[i], words[i], int(prior[i]), "reads", -1)
                same = sm.repoch[words] == epoch
                old = sm.reader[words]
                new = np.where(same & (old != actor) & (old != -1), -2, actor)
                sm.reader[words] = new
                sm.repoch[words] = epoch
                # several lanes reading one word in this instruction: "many"
                uniq, counts = np.unique(words, return_counts=True)
                if (counts > 1).any():
                    sm.reader[uniq[counts > 1]] = -2

    def _race(self, lane, word, other, verb, reader) -> None:
        row = self.smem.bytes.shape[1]
        block, offset = divmod(int(word) * 4, row)
        if other is None:
            by = "read by another thread" if reader == -2 else f"read by {self.who(int(reader))}"
        else:
            by = f"written by {self.who(int(other))}"
        raise RaceError(
            f"{self.kernel}: race: {self.who(int(lane))} {verb} shared word {offset:#x} of "
            f"block {self.first_block + block}, {by} with no barrier between (lockstep "
            "would hide it; set KBUILD_INTERPRET_RACES=0 to run on regardless)"
        )

    # -- what inline asm acts on (dsl.asm_semantics) -----------------------------------

    def mbarrier_init(self, bar, count) -> None:
        threads.mbarrier_init(self, bar, count)

    def arrive_expect_tx(self, bar, nbytes) -> None:
        threads.arrive_expect_tx(self, bar, nbytes)

    def wait_parity(self, bar, parity) -> None:
        threads.wait_parity(self, bar, parity)

    def store_async(self, slot, word, bar, rank) -> None:
        threads.store_async(self, slot, word, bar, rank)

    def ticks(self) -> np.ndarray:
        self._ticks += 1
        return np.full(self.lanes, self._ticks, np.int64)

    # -- barriers -----------------------------------------------------------------------

    def check_uniform(self, what: str, span: int) -> None:
        """Every thread of each block (`span` = block) or cluster active, or none: a barrier
        that only part of a block reaches hangs or corrupts on the GPU."""
        groups = self.mask.reshape(-1, span)
        some, every = groups.any(axis=1), groups.all(axis=1)
        bad = some & ~every
        if bad.any():
            g = int(np.argmax(bad))
            missing = g * span + int(np.argmax(~groups[g]))
            present = g * span + int(np.argmax(groups[g]))
            raise self.fault(
                f"{what} reached by only part of its threads (barrier divergence: "
                f"{self.who(missing)} is not there)",
                present,
            )

    def barrier(self) -> None:
        self.check_uniform("block barrier", self.block)
        active = self.mask.reshape(-1, self.block).any(axis=1)
        self.smem.epoch[active] += 1

    def cluster_barrier(self) -> None:
        span = self.block * self.cluster
        self.check_uniform("cluster barrier", span)
        active = self.mask.reshape(-1, span).any(axis=1)
        self.smem.epoch[np.repeat(active, self.cluster)] += 1


def run(
    program: Program,
    grid,
    args: tuple,
    warp_size: int,
    dynamic_shared: int = 0,
) -> None:
    """Run `program` over `grid` blocks with the kernel's arguments (addresses and ints)."""
    dims = (grid,) if isinstance(grid, int) else tuple(grid)
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    if len(args) != len(program.params):
        raise TypeError(f"{program.name} takes {len(program.params)} arguments, got {len(args)}")
    if dims[0] % program.cluster:
        raise KernelFault(
            f"{program.name}: a grid of {dims[0]} blocks in x is not a whole number of "
            f"clusters of {program.cluster}"
        )
    total = dims[0] * dims[1] * dims[2]
    if total == 0:
        return
    per = max(1, LANES_PER_CHUNK // max(1, program.block) // program.cluster) * program.cluster
    gmem = ALLOCATIONS.snapshot()
    for first in range(0, total, per):
        blocks = min(per, total - first)
        m = Machine(program, dims, first, blocks, warp_size, dynamic_shared, gmem)
        for slot, t, value in zip(program.params, program.param_types, args, strict=True):
            m.vals[slot] = splat(value, t, m.lanes)
        run_region(program.body, m)
