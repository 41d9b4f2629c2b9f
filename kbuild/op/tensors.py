"""What every op shares: argument checks, dtype names, rows view, device guard, streams."""

from __future__ import annotations

import contextlib
import math

import torch

from .. import env
from ..registry import MAX_GROUPED_ROWS, group_magic

# KBUILD_INTERPRET (read once, at import): CPU tensors take the CUDA path, on the interpreter.
INTERPRETED = env.interpret()
if INTERPRETED:
    from ..interpret.launcher import track_data_ptr

    track_data_ptr()


def on_gpu(t: torch.Tensor) -> bool:
    """Whether `t` takes the GPU path (kernels): a CUDA tensor, or under the interpreter a
    CPU one."""
    return t.is_cuda or (INTERPRETED and t.device.type == "cpu")


def is_current(t: torch.Tensor) -> bool:
    """Whether t's device is the current CUDA device (the interpreter's CPU always is)."""
    return INTERPRETED or t.get_device() == torch._C._cuda_getDevice()


DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# Integer ids as the kernel table names them (an "index" parameter: token ids, targets).
INDEX_NAMES = {torch.int32: "i32", torch.int64: "i64"}
_ACCEPTED = "torch.float32, torch.float16 or torch.bfloat16"


def dtype_name(t: torch.Tensor | None) -> str | None:
    """A tensor's dtype as kernels name it ("bf16", ...; ids "i32" / "i64"); None for no
    tensor."""
    if t is None:
        return None
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = INDEX_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"kbuild kernels take float or int32/int64 tensors, got {t.dtype}")
    return name


def check_input(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name} must be {_ACCEPTED}; got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (..., N); got a scalar")
    return x


def check_like(
    name: str, t: object, x: torch.Tensor, x_name: str = "x", or_fp32: bool = False
) -> torch.Tensor:
    """`t` must match `x` in shape, dtype (or be fp32, with `or_fp32`) and device."""
    check_input(name, t)
    if t.shape != x.shape:
        raise ValueError(
            f"{name} must have the shape of {x_name} {tuple(x.shape)}; got {tuple(t.shape)}"
        )
    if t.dtype != x.dtype and not (or_fp32 and t.dtype == torch.float32):
        also = " or float32" if or_fp32 else ""
        raise TypeError(f"{name} must have the dtype of {x_name} ({x.dtype}){also}; got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on {x_name}'s device {x.device}; got {t.device}")
    return t


def check_param(name: str, p: object, x: torch.Tensor, x_name: str = "x") -> torch.Tensor | None:
    """A per-feature parameter (weight, bias): None, or (N,) of x's dtype or fp32 on x's device
    (`x_name`: what the messages call x)."""
    if p is None:
        return None
    if (
        (  # the common CUDA case, by the cheapest reads (device objects cost ~1 us)
            p.__class__ is torch.nn.Parameter or p.__class__ is torch.Tensor
        )
        and p.dim() == 1
        and p.shape[0] == x.shape[-1]
        and (p.dtype is x.dtype or p.dtype is torch.float32)
        and on_gpu(x)
        and on_gpu(p)
        and p.get_device() == x.get_device()
        and p.is_contiguous()
    ):
        return p
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
    n = x.shape[-1]
    if p.shape != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) to match {x_name}'s last dimension; got "
            f"{tuple(p.shape)}"
        )
    if p.dtype is not x.dtype and p.dtype is not torch.float32:
        raise TypeError(
            f"{name} must have {x_name}'s dtype ({x.dtype}) or torch.float32; got {p.dtype}"
        )
    if p.device != x.device:
        raise ValueError(f"{name} must be on {x_name}'s device {x.device}; got {p.device}")
    return contiguous(p)  # kernels read it as a dense (N,) array (a strided view would not be)


def check_eps(eps: object) -> float:
    # Comparisons only (no math.isfinite): under torch.compile eps may be a symbolic float,
    # which compares but does not convert. NaN fails both comparisons.
    if eps.__class__ is float and 0.0 <= eps < math.inf:  # the common case, checked cheaply
        return eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, torch.SymFloat)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0; got {eps}")
    return eps if isinstance(eps, torch.SymFloat) else float(eps)


def check_offset(offset: object, weight: torch.Tensor | None) -> float:
    """RMSNorm's weight offset: None (0) or a finite float, nonzero only with a weight.

    The public functions default it to None, not 0.0: under torch.compile(dynamic=True) a
    float default becomes a symbolic input, and the kernel parameter it feeds then costs a
    second compile of the frame."""
    if offset is None:
        return 0.0
    if isinstance(offset, bool) or not isinstance(offset, (int, float, torch.SymFloat)):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if not -math.inf < offset < math.inf:
        raise ValueError(f"offset must be a finite number; got {offset}")
    if offset != 0 and weight is None:
        raise ValueError(f"offset = {offset} scales a weight (offset + weight): weight is None")
    return float(offset)  # a compile-time constant of the kernel (specialised under compile)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def grouped_rows(x: torch.Tensor) -> tuple[int, int] | None:
    """Where the rows of a non-contiguous (..., N) tensor lie, for the kernels that read x at a
    two-level stride (dsl.rows.GroupedRows): (x_group, x_stride), row r starting at
    (r // x_group) * x_stride + (r % x_group) * N; x_group is M for rows that are dense after
    all (a size-1 dimension's stride is arbitrary); None where the rows cannot be read so (the
    last dimension is not contiguous, or the outer dimensions do not merge into one stride,
    or there are more than 2^31 rows).

    The (B, T, H, D) view of a fused qkv projection (strides (T * S, S, D, 1)) is
    (H, S): the token dimensions merge into one stride, the heads are contiguous rows."""
    N = x.shape[-1]
    if x.stride(-1) != 1 and N > 1:
        return None
    dims = [(n, s) for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n != 1]
    group, expected = 1, N
    while dims and dims[-1][1] == expected:  # the contiguous rows of the innermost dimensions
        n, _ = dims.pop()
        group, expected = group * n, expected * n
    if not dims:
        return group, 0
    if row_count(x) > MAX_GROUPED_ROWS:
        return None
    count, stride = dims.pop()
    step = stride
    while dims:  # the rest must be one stride: each dimension steps over the one inside it
        n, s = dims.pop()
        if s != step * count:
            return None
        step, count = s, n
    return group, stride


def rows_to_read(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """x as RMSNorm's kernels read it, and the strided kernels' (x_group, x_stride,
    x_group_magic) launch arguments: x itself with None when its rows are dense, x itself with
    the arguments when grouped_rows finds its layout, else a contiguous copy with None. The
    twin of `readable_rows` in kbuild/native/launch.h."""
    if x.is_contiguous():
        return x, None
    layout = grouped_rows(x)
    if layout is None:
        return x.contiguous(), None
    group, stride = layout
    if group == row_count(x):  # dense after all
        return x, None
    return x, (group, stride, group_magic(group))


def readable_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when a strided-row kernel can read it in place (contiguous, or grouped_rows
    finds its layout), else a contiguous copy. What the RMSNorm forward saves for backward."""
    return rows_to_read(x)[0]


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """`torch.cuda.device(t.device)` when that is not already current (entering costs ~2 us)."""
    if is_current(t):  # CUDA is initialised: x lives there
        return _NO_GUARD
    return torch.cuda.device(t.device)


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (never under the
    interpreter, whose CPU torch has no CUDA to ask)."""
    return not INTERPRETED and torch.cuda.is_current_stream_capturing()


def stream_of(device_index: int) -> int:
    if device_index < 0:  # the interpreter's CPU "device": one stream
        return 0
    return torch._C._cuda_getCurrentRawStream(device_index)


def data_ptrs(*tensors: torch.Tensor | None) -> list[int]:
    """The addresses of the tensors given (None skipped): a kernel's pointer arguments."""
    return [t.data_ptr() for t in tensors if t is not None]


def aligned(*ptrs: int) -> bool:
    """All addresses 16-byte aligned, so 128-bit vector accesses are legal."""
    combined = 0
    for p in ptrs:
        combined |= p
    return combined & 15 == 0


def row_count(t: torch.Tensor) -> int:
    """M for a (..., N) tensor seen as (M, N) rows, also when N is 0 (symbolic-shape safe:
    torch.Size.numel would specialise a dynamic batch dimension under torch.compile)."""
    return math.prod(t.shape[:-1])


def empty_row_stats(stats: torch.Tensor | None) -> torch.Tensor | None:
    """Statistics of rows with no elements are undefined: NaN, as torch's mean of nothing."""
    return None if stats is None else stats.fill_(float("nan"))
