"""Regions as closures, and running them under the machine's mask.

`region(program, region)` turns each op of a region into its closure (the op's maker in
op_table.OPS); `run_region` runs it and returns what its terminator yields. A single-block
region (the builder's scf bodies) runs op after op. A multi-block region (the lowered
module's unstructured control flow, cf / llvm branches) is a graph of blocks: its
terminators return a `Jump`, and `run_blocks` gives each lane a program counter (its block);
the lanes waiting at the earliest block in the region's order run it together. The
structured lowering (scf -> cf) lays a construct's blocks out before the block that follows
it, so lanes that took different branches meet again where their paths join, and a loop's
lanes run its body until the last one leaves before any runs what comes after the loop.
(Reverse post-order is not enough: it may place a loop's exit before its body.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .op_table import OPS


class Region:
    __slots__ = ("blocks", "args", "successors")

    def __init__(self, blocks, args, successors) -> None:
        self.blocks = blocks  # [[closure...]] one list a block
        self.args = args  # per block: the slots of its arguments
        self.successors = successors  # per block: the indices its terminator may go to


def region(program, reg) -> Region:
    blocks = list(reg.blocks)
    args = [[program.slot(a) for a in block.arguments] for block in blocks]
    successors = [[] for _ in blocks]
    if len(blocks) > 1:
        for i, block in enumerate(blocks):
            last = list(block.operations)[-1].operation
            successors[i] = [_index_of(blocks, s) for s in last.successors]
    made = [[_make(program, o) for o in block.operations] for block in blocks]
    return Region(made, args, successors)


def _index_of(blocks, block) -> int:
    for i, b in enumerate(blocks):
        if b == block:
            return i
    raise ValueError("a branch to a block outside its region")


def _make(program, o) -> Callable:
    name = o.operation.name
    maker = OPS.get(name)
    if maker is None:
        raise NotImplementedError(f"the interpreter does not know {name} (in {program.name})")
    return maker(program, o.operation)


def run_region(reg: Region, m) -> list | None:
    """Run a region: a single-block one returns what its terminator yields (slots' values);
    a multi-block one runs to its returns (None)."""
    if len(reg.blocks) > 1:
        return run_blocks(reg, m)
    out = None
    for fn in reg.blocks[0]:
        out = fn(m)
    return out


class Jump:
    """A terminator's outcome: per lane, the successor index it goes to and the values it
    passes (successor k gets `args[k]`); a lane going nowhere (-1) has returned."""

    __slots__ = ("target", "args")

    def __init__(self, target: np.ndarray, args: list[list[np.ndarray]]):
        self.target, self.args = target, args


def run_blocks(reg, m) -> None:
    """Run a multi-block region to its returns (every active lane reaches one)."""
    outer = m.mask
    pc = np.where(outer, 0, -1)
    while True:
        waiting = pc >= 0
        if not waiting.any():
            break
        here = int(pc[waiting].min())
        lanes = pc == here
        m.mask = lanes
        jump = None
        for fn in reg.blocks[here]:
            jump = fn(m)
        if not isinstance(jump, Jump):
            pc = np.where(lanes, -1, pc)
            continue
        targets = reg.successors[here]
        going = np.where(lanes, jump.target, -2)
        for k, dest in enumerate(targets):
            taking = going == k
            if not taking.any():
                continue
            for slot, value in zip(reg.args[dest], jump.args[k], strict=True):
                old = m.vals[slot]
                if old is None or old.shape != value.shape:
                    old = np.zeros_like(value)
                mask = taking if value.ndim == 1 else taking[:, None]
                m.vals[slot] = np.where(mask, value, old)
            pc = np.where(taking, dest, pc)
        pc = np.where(lanes & (going == -1), -1, pc)
    m.mask = outer
