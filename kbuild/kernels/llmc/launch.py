"""GPT-2's encoder (wte[tokens] + wpe[t]) and a linear layer's bias gradient on tensors:
launches of the kernels in kbuild/kernels/llmc/encoder.py and kernels/reduce.py, and the torch
references (fp32 math) that CPU tensors run and the tests hold the kernels to.

Launch functions take contiguous CUDA tensors that the public functions (kernels/llmc/op.py)
checked; each gives the kernel table's parameter values in its order and the pointers in its
argument order.
"""

from __future__ import annotations

import functools

import torch

from ...op.launch import column_sum, launcher_for
from ...op.tensors import DTYPE_NAMES, INDEX_NAMES, aligned, stream_of
from ...plan.config import ENCODER_CHUNK as CHUNK
from ..reduce import BIAS_GRAD
from .encoder import ENCODER_BWD_WPE, ENCODER_BWD_WTE, ENCODER_BWD_WTE_MERGE, ENCODER_FWD

encoder_fwd_spec = ENCODER_FWD.spec
encoder_bwd_wpe_spec = ENCODER_BWD_WPE.spec
encoder_bwd_wte_spec = ENCODER_BWD_WTE.spec
encoder_bwd_wte_merge_spec = ENCODER_BWD_WTE_MERGE.spec
bias_grad_spec = BIAS_GRAD.spec

# ----------------------------------------------------------------------------- encoder


def encoder_fwd(tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor) -> torch.Tensor:
    """(B, T, C) = wte[tokens] + wpe[:T]; rows of ids outside [0, V) are NaN."""
    B, T = tokens.shape
    V, C = wte.shape
    out = torch.empty(B, T, C, dtype=wte.dtype, device=wte.device)
    M = B * T
    if M == 0 or C == 0:
        return out
    ptrs = (tokens.data_ptr(), wte.data_ptr(), wpe.data_ptr(), out.data_ptr())
    values = (C, DTYPE_NAMES[wte.dtype], INDEX_NAMES[tokens.dtype], aligned(*ptrs[1:]))
    device = wte.get_device()
    launcher = launcher_for(ENCODER_FWD, device, values)
    launcher(M, stream_of(device), *ptrs, V, T, M)
    return out


def encoder_bwd(
    dout: torch.Tensor,
    tokens: torch.Tensor,
    dwte: torch.Tensor | None,
    dwpe: torch.Tensor | None,
    add_to_dwpe: bool = True,
) -> None:
    """dwte += the sums of dout's rows by token id, dwpe[:T] += dout summed over the batch
    (= with `add_to_dwpe` False: dwpe's old values are not read); in place, either may be
    None (not wanted). Deterministic: a stable sort of the ids, then fixed-order fp32 sums
    (kernels/llmc/encoder.py). Ids outside [0, V) add nothing."""
    B, T = tokens.shape
    C = dout.shape[-1]
    M = B * T
    if M == 0 or C == 0:
        return
    device = dout.get_device()
    stream = stream_of(device)
    dtype = DTYPE_NAMES[dout.dtype]
    if dwpe is not None:
        ptrs = (dout.data_ptr(), dwpe.data_ptr())
        values = (C, dtype, add_to_dwpe, aligned(*ptrs))
        launcher = launcher_for(ENCODER_BWD_WPE, device, values)
        launcher(T, stream, *ptrs, B, T)
    if dwte is not None:
        sorted_ids, order = torch.sort(tokens.reshape(-1), stable=True)
        chunks = -(-M // CHUNK)
        partial = torch.empty(chunks, 2, C, dtype=torch.float32, device=dout.device)
        is_aligned = aligned(dout.data_ptr(), dwte.data_ptr())
        values = (C, dtype, INDEX_NAMES[tokens.dtype], is_aligned)
        V = dwte.shape[0]
        first = launcher_for(ENCODER_BWD_WTE, device, values)
        first(chunks, stream, sorted_ids.data_ptr(), order.data_ptr(), dout.data_ptr(),
              dwte.data_ptr(), partial.data_ptr(), V, M)  # fmt: skip
        merge = launcher_for(ENCODER_BWD_WTE_MERGE, device, values)
        merge(chunks, stream, sorted_ids.data_ptr(), partial.data_ptr(), dwte.data_ptr(), V, M)


def encoder_reference(tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor) -> torch.Tensor:
    """The forward in plain torch: fp32 sum, rounded once to wte's dtype."""
    T = tokens.shape[-1]
    return (wte.float()[tokens] + wpe.float()[:T]).to(wte.dtype)


def encoder_bwd_reference(
    dout: torch.Tensor, tokens: torch.Tensor, V: int, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dwte, dwpe) in fp32 (V, C) and (positions, C): the backward's sums, in plain torch."""
    C = dout.shape[-1]
    d = dout.float().reshape(-1, C)
    dwte = torch.zeros(V, C, dtype=torch.float32, device=dout.device)
    dwte.index_add_(0, tokens.reshape(-1).long(), d)
    dwpe = torch.zeros(positions, C, dtype=torch.float32, device=dout.device)
    T = tokens.shape[-1]
    dwpe[:T] = dout.float().reshape(-1, T, C).sum(0)
    return dwte, dwpe


# ----------------------------------------------------------------------------- bias gradient

MIN_CHUNK_ROWS = 64  # fewer rows per chunk would make the partials cost more than dout


@functools.cache
def multiprocessors(device: int) -> int:
    """The device's multiprocessors (the interpreter's count for its CPU device, -1)."""
    if device < 0:  # the interpreter's CPU device
        from ...interpret.launcher import SMS

        return SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def bias_chunks(M: int, column_blocks: int, units: int) -> tuple[int, int]:
    """(chunks, rows per chunk) for the first pass over M rows: about four blocks per
    multiprocessor in all, never chunks under MIN_CHUNK_ROWS rows. Fixed by (M, the kernel,
    the device), so the summation order and every bit of dbias are too."""
    wanted = max(1, -(-4 * units // column_blocks))
    chunks = max(1, min(wanted, M // MIN_CHUNK_ROWS))
    per_chunk = -(-M // chunks)
    return -(-M // per_chunk), per_chunk


def bias_grad(dout: torch.Tensor) -> torch.Tensor:
    """dbias = dout.sum over rows, for a contiguous (M, OC) CUDA dout; fp32 sums, two
    fixed-order passes (row chunks, then the column sum), result in dout's dtype."""
    M, OC = dout.shape
    if M == 0 or OC == 0:
        return torch.zeros(OC, dtype=dout.dtype, device=dout.device)
    device = dout.get_device()
    stream = stream_of(device)
    values = (OC, DTYPE_NAMES[dout.dtype], aligned(dout.data_ptr()))
    launcher = launcher_for(BIAS_GRAD, device, values)
    column_blocks = -(-OC // launcher.meta["columns_per_block"])
    chunks, per_chunk = bias_chunks(M, column_blocks, multiprocessors(device))
    partial = torch.empty(1, chunks, OC, dtype=torch.float32, device=dout.device)
    launcher(chunks * column_blocks, stream, dout.data_ptr(), partial.data_ptr(), M, per_chunk)
    return column_sum(partial, dout.dtype, device, stream)[0]


def bias_grad_reference(dout: torch.Tensor) -> torch.Tensor:
    return dout.float().reshape(-1, dout.shape[-1]).sum(0).to(dout.dtype)
