"""A model of the lagged cluster exchange (dsl.exchange, "lagged") run under random
interleavings: the ordering argument of that module's docstring, checked by execution.

Each of C blocks walks R rows. Step j: send row j's value to every block (one st.async per
peer: written into slot [j % B][rank] of that peer and counted on its mbarrier [j % B], both
landing whenever the model delivers the message), then, but at step 0, receive row j - 1:
arrive on the own mbarrier [(j - 1) % B] expecting C values, wait for the phase of parity
((j - 1) // B) % 2, and read the C slots. After the loop the last row is received. A block
barrier separates a step's reads from the next step's send (the model runs a block's
operations in order, which is what that barrier gives across its threads). The scheduler
picks any block that can move or any message in flight, at random.

With four buffers every read sees the row it expects and every run ends; with three, a
block sends row j + 3 into the slots of row j while a slower peer has yet to read them.
"""

from __future__ import annotations

import random

import pytest


class _Barrier:
    """An mbarrier with one arrival a phase and a transaction count."""

    def __init__(self):
        self.completed = 0  # phases completed so far
        self.pending, self.tx = 1, 0

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = 1

    def arrive_expect(self, count: int):
        self.pending -= 1
        self.tx += count
        self._advance()

    def complete_tx(self):
        self.tx -= 1
        self._advance()

    def passed(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed (the current one has the
        other parity)."""
        return self.completed % 2 != parity


def _run(C: int, R: int, B: int, seed: int) -> str | None:
    """None if every block read what it should and finished; else what went wrong."""
    rng = random.Random(seed)
    slots = [[[None] * C for _ in range(B)] for _ in range(C)]
    bars = [[_Barrier() for _ in range(B)] for _ in range(C)]
    in_flight = []  # (receiver, buffer, rank, value)

    def program(me: int):
        for j in range(R + 1):
            if j < R:
                for peer in range(C):  # one st.async a peer
                    in_flight.append((peer, j % B, me, (j, me)))
                    yield
            if j >= 1:  # receive the row before
                row = j - 1
                bars[me][row % B].arrive_expect(C)
                while not bars[me][row % B].passed((row // B) % 2):
                    yield  # spins: the phase has not completed yet
                for rank in range(C):
                    if slots[me][row % B][rank] != (row, rank):
                        raise AssertionError(
                            f"block {me} read {slots[me][row % B][rank]} for row {row} of "
                            f"block {rank}"
                        )
                    yield

    blocks = {me: program(me) for me in range(C)}
    moves = 0
    try:
        while blocks or in_flight:
            moves += 1
            if moves > 200_000:  # random picks: a run that can progress ends long before
                return "no progress (a wait that nothing can complete)"
            choices = list(blocks) + [("deliver", i) for i in range(len(in_flight))]
            pick = rng.choice(choices)
            if isinstance(pick, tuple):
                peer, buffer, rank, value = in_flight.pop(pick[1])
                slots[peer][buffer][rank] = value
                bars[peer][buffer].complete_tx()
                continue
            try:
                next(blocks[pick])
            except StopIteration:
                del blocks[pick]
    except AssertionError as error:
        return str(error)
    return None


@pytest.mark.parametrize("seed", range(40))
def test_four_buffers_keep_every_row_intact(seed):
    assert _run(C=4, R=12, B=4, seed=seed) is None


def test_three_buffers_let_a_fast_block_overwrite_a_row_not_yet_read():
    failures = [r for r in (_run(C=3, R=12, B=3, seed=s) for s in range(50)) if r]
    assert failures, "three buffers should not be enough for a lag of one row"
