"""Transaction barriers (`mbarrier`) and asynchronous stores into a cluster peer's shared
memory (`st.async`), sm_90 on: a block can wait for data that other blocks send it without a
cluster-wide barrier (see dsl.exchange).

An mbarrier is a 64-bit object in shared memory. A phase completes when its expected arrivals
have arrived and the bytes it was told to expect (`arrive_expect_tx`) have landed; a store
sent with `store_async` counts its bytes against the barrier in the receiving block. Waiters
name the phase by its parity. Written as inline PTX: the instruction forms and their memory
semantics are then exactly those of the PTX ISA, whatever the MLIR version.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir.dialects import llvm

from .values import V, cast, const, scalar_type
from .values import inline_asm as _asm


def _i32(v: V | int) -> V:
    return const(v, "i32") if isinstance(v, int) else cast(v, "i32")


def _shared32(ptr: V) -> V:
    """A shared-memory pointer as the 32-bit address PTX's shared state space takes (one
    register instead of two)."""
    return V(llvm.PtrToIntOp(scalar_type("i32"), ptr.value).result)


def mbarrier_init(bar: V, arrivals: int) -> None:
    """Initialise the mbarrier at `bar` (shared) for `arrivals` arrivals per phase."""
    text = "mbarrier.init.shared::cta.b64 [$0], $1;"
    _asm(text, "r,r", [_shared32(bar), _i32(arrivals)], meaning=_init)


def fence_mbarrier_init() -> None:
    """Make this thread's mbarrier initialisations visible to the cluster (pairs with the
    cluster barrier that follows)."""
    _asm("fence.mbarrier_init.release.cluster;", "", [], meaning=_nothing)


def arrive_expect_tx(bar: V, nbytes: V | int) -> None:
    """Arrive at the local mbarrier `bar` and add `nbytes` to the bytes its current phase
    waits for. Bytes that landed before this call already count."""
    _asm(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        "r,r",
        [_shared32(bar), _i32(nbytes)],
        meaning=_arrive_expect_tx,
    )


# Spin on try_wait until the phase of parity `parity` of the mbarrier at `bar` completes.
_WAIT = (
    "WAIT_${{:uid}}:\n"
    "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [{bar}], {parity};\n"
    "@!done bra WAIT_${{:uid}};\n"
)


def wait_parity(bar: V, parity: V | int) -> None:
    """Spin until the phase of `bar` with this parity (0 for its first phase) has completed;
    stores that completed it, from any block of the cluster, are then visible."""
    text = "{\n.reg .pred done;\n" + _WAIT.format(bar="$0", parity="$1") + "}"
    _asm(text, "r,r", [_shared32(bar), _i32(parity)], meaning=_wait)


def wait_parity_derived(base: V, word: V, derive: str, meaning: Callable) -> None:
    """`wait_parity` on an mbarrier that PTX `derive` picks inside the instruction sequence:
    from $0 (the 32-bit shared address of `base`) and $1 (`word`, as i32) it sets registers
    `bar` (the mbarrier's address) and `parity` (`offset` is scratch). Nothing but `word`
    then stays live while the wait is pending (see dsl.exchange: a pair used in turn).
    `meaning(base, word) -> (bar, parity)` is `derive` for the interpreter (numpy arrays)."""

    def wait(machine, base_address, word_value):
        machine.wait_parity(*meaning(base_address, word_value))

    text = "{\n.reg .b32 bar, parity, offset;\n.reg .pred done;\n" + derive
    text += _WAIT.format(bar="bar", parity="parity") + "}"
    _asm(text, "r,r", [_shared32(base), _i32(word)], meaning=wait)


def store_async(slot: V, value: V, bar: V, rank: V) -> None:
    """Store an f32 into block `rank`'s copy of the shared slot `slot` (this block's address
    of it) and count its 4 bytes against that block's copy of the mbarrier `bar`. The peer
    addresses are formed inside the instruction sequence (`mapa`, 32-bit), so they take no
    registers beyond it."""
    word = V(llvm.BitcastOp(scalar_type("i32"), value.value).result)
    _asm(
        "{\n"
        ".reg .b32 peer_slot, peer_bar;\n"
        "mapa.shared::cluster.u32 peer_slot, $0, $3;\n"
        "mapa.shared::cluster.u32 peer_bar, $2, $3;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [peer_slot], $1, [peer_bar];\n"
        "}",
        "r,r,r,r",
        [_shared32(slot), word, _shared32(bar), _i32(rank)],
        meaning=_store_async,
    )


# What the PTX above computes, for the interpreter (dsl.asm_semantics): the machine keeps
# each mbarrier's arrivals, expected bytes and phase.
def _init(machine, bar, arrivals):
    machine.mbarrier_init(bar, arrivals)


def _nothing(machine):
    return None


def _arrive_expect_tx(machine, bar, nbytes):
    machine.arrive_expect_tx(bar, nbytes)


def _wait(machine, bar, parity):
    machine.wait_parity(bar, parity)


def _store_async(machine, slot, word, bar, rank):
    machine.store_async(slot, word, bar, rank)
