"""Launch shapes shared by the ops: one block per row group, or a persistent grid whose
blocks each leave an fp32 partial row of the parameter gradients, summed in a fixed order.

Every kernel is looked up through `launcher_for(kernel_def, device, values)`: the memory
tier's key is the table's kernel name, the parameter values as the op gives them (in the
table's order, kbuild/registry.py) and the device index, so the key and the spec are
the same description; pointer arguments are passed in the table's argument order.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch

from ..jit import get_launcher, loaded
from ..registry import KernelDef, kernel_def
from ..spec import Scalar
from .tensors import DTYPE_NAMES, INDEX_NAMES, on_gpu, stream_of

# The Ids arguments of the `Op(cuda=)` call running now, (op name, {argument name: tensor}),
# set by `Op._user_cuda`: its launches are checked to bind each one's dtype (`_check_ids`).
IDS_IN_CALL: ContextVar[tuple[str, dict] | None] = ContextVar("kbuild_ids_in_call", default=None)


def launcher_for(kernel: KernelDef, device: int, values: tuple[Scalar, ...]):
    """The loaded kernel `kernel.spec(*values)` on `device`: one dict lookup on a hit."""
    key = (kernel.name, values, device)  # nested: no unpacking on the hot path
    launcher = loaded(key)
    if launcher is None:
        launcher = get_launcher(key, device, lambda: kernel.spec(*values))
    return launcher


def record_fields(launcher) -> dict:
    """What the C++ launches keep of a loaded kernel (native/launch.h and generic.h `Record`):
    the driver's function, block, shared memory and the grid's shape."""
    return dict(
        function_handle=launcher.function_handle,
        block=launcher.block,
        shared=launcher.dynamic_shared,
        cluster=launcher.cluster,
        rows_per_block=launcher.rows_per_block,
        resident_clusters=launcher.resident_clusters,
        persistent=launcher.meta.get("grid") == "persistent",
    )


def launch_kernel(
    definition: KernelDef, grid, *args: torch.Tensor | int, stream: int | None = None, **params
) -> None:
    """Run the kernel `definition.spec(**params)` over `grid` blocks with `args` in its
    argument order (`definition.arg_names`): tensors, all on one CUDA device, pass their data
    pointers, Python ints the i64 scalars. `grid` is a block count (or a tuple of the counts
    in x, y and z, for kernels reading `k.block_id("y")`), or a function of the
    loaded launcher returning one (its `meta`, `rows_per_block`, `cluster`: what the builder
    chose). On the current stream of the tensors' device unless `stream` is given. The
    kernel compiles on first use (or comes from the cache) and stays loaded per device."""
    if not isinstance(definition, KernelDef):
        raise TypeError(
            f"kbuild.launch takes a kernel definition (a KernelDef), not {definition!r}: the "
            "builder decorated with @kbuild.kernel is one (kbuild.launch(build_scale, grid, "
            "...)), and kbuild.registry.kernel_def(name) finds one by its name"
        )
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError(f"{definition.name}: args hold no tensor to say which device runs it")
    for a in args:
        if not isinstance(a, (torch.Tensor, int)) or isinstance(a, bool):
            raise TypeError(f"{definition.name}: args are tensors and ints, got {type(a).__name__}")
    ids = IDS_IN_CALL.get()
    if ids is not None:
        _check_ids(definition, tensors, params, *ids)
    devices = {t.get_device() for t in tensors}
    if not all(on_gpu(t) for t in tensors) or len(devices) > 1:
        where = sorted({str(t.device) for t in tensors})
        raise ValueError(f"{definition.name}: args must be tensors on one CUDA device, got {where}")
    device = devices.pop()
    # floats by their bits, as the disk key does: 0.0 and -0.0 are two kernels
    exact = tuple(sorted((k, v.hex() if isinstance(v, float) else v) for k, v in params.items()))
    key = (definition.name, exact, device)
    launcher = loaded(key) or get_launcher(key, device, lambda: definition.spec(**params))
    signature = launcher.meta.get("signature")
    if signature is not None:
        _check_kinds(definition.name, signature, args)
    blocks = grid(launcher) if callable(grid) else grid
    blocks = int(blocks) if not isinstance(blocks, tuple) else tuple(map(int, blocks))
    pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    launcher(blocks, stream_of(device) if stream is None else stream, *pointers)


def _check_ids(
    definition: KernelDef, tensors: list, params: dict, op: str, ids: dict[str, torch.Tensor]
) -> None:
    """Inside an `Op(cuda=)` call: a kernel reading one of the op's Ids tensors (its data,
    the tensor or a view of the same address) has an "index" parameter set to its dtype
    (i32 / i64); without one the kernel reads the ids as its own default type (int32 ids read
    as int64: every other id and garbage past the end)."""
    for name, t in ids.items():
        if t is None or not t.numel() or t.dtype not in INDEX_NAMES:
            continue
        if not any(a.dtype == t.dtype and a.data_ptr() == t.data_ptr() for a in tensors):
            continue
        want = INDEX_NAMES[t.dtype]
        index = [p for p in definition.params if p.kind == "index"]
        given = {p.name: params.get(p.name, p.default) for p in index}
        if want not in given.values():
            got = f"its index parameters are {given}" if index else "it has none"
            raise ValueError(
                f"{op}: the Ids argument {name!r} ({t.dtype}) is read by kernel "
                f'{definition.name}, which needs an "index" parameter set to {want!r} (else '
                f"the ids are read as another integer type), and {got}"
            )


def _check_kinds(kernel: str, signature: list, args: tuple) -> None:
    """A tensor for each pointer argument and an int for each i64: an int passed as a pointer
    would be dereferenced on the GPU (an illegal address that breaks the context), a tensor
    passed as an i64 read as its address."""
    if len(args) != len(signature):
        names = ", ".join(name for name, _ in signature)
        raise TypeError(f"{kernel} takes {len(signature)} arguments ({names}), got {len(args)}")
    for (name, kind), value in zip(signature, args, strict=True):
        if (kind == "ptr") != isinstance(value, torch.Tensor):
            want = "a tensor" if kind == "ptr" else "an int"
            raise TypeError(f"{kernel}: argument {name} must be {want}, got {type(value).__name__}")


def rows_grid(launcher, M: int) -> int:
    """Blocks for a forward kernel: one per row group (times the cluster size), or for a
    persistent one, as many as the device holds at once (see `persistent_grid`)."""
    if launcher.meta.get("grid") == "persistent":
        return persistent_grid(launcher, M)[0]
    return -(-M // launcher.rows_per_block) * launcher.cluster


def persistent_grid(launcher, M: int) -> tuple[int, int]:
    """(blocks, workspace rows) of a persistent kernel over M rows: as many clusters as the
    device holds at once (never more than there are row groups), one partial row each (a
    block of several rows adds them first). Fixed per device and kernel, so the reduction
    order is too."""
    clusters = min(-(-M // launcher.rows_per_block), launcher.resident_clusters)
    return clusters * launcher.cluster, clusters


def launch_rows(
    kernel: KernelDef, values: tuple[Scalar, ...], device: int, M: int, ptrs: Sequence[int]
) -> None:
    launcher = launcher_for(kernel, device, values)
    launcher(rows_grid(launcher, M), stream_of(device), *ptrs, M)


def column_sum(
    partial: torch.Tensor, out_dtype: torch.dtype, device: int, stream: int
) -> list[torch.Tensor]:
    """Sum the rows of each plane of an fp32 (planes, R, N) workspace (1 or 2 planes) in a
    fixed order; one (N,) tensor per plane, in one launch."""
    planes, R, N = partial.shape
    outs = [torch.empty(N, dtype=out_dtype, device=partial.device) for _ in range(planes)]
    launcher = launcher_for(kernel_def("column_sum"), device, (N, DTYPE_NAMES[out_dtype], planes))
    grid = planes * -(-N // launcher.meta["columns_per_block"])
    launcher(grid, stream, partial.data_ptr(), *(o.data_ptr() for o in outs), R)
    return outs


def launch_persistent(
    kernel: KernelDef,
    values: tuple[Scalar, ...],
    device: int,
    M: int,
    N: int,
    ptrs: list[int],
    *params: torch.Tensor | None,
    layout: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor | None, ...] | None:
    """Run a backward kernel on a persistent grid; return the gradient of each of `params`
    (None where a param is None, i.e. not wanted).

    The kernel takes `ptrs`, then one fp32 (clusters, N) workspace per
    wanted param, then M, then `layout` when given (a strided x's row arguments). The
    grid is what the device holds at once (fixed per device and kernel), so the summation
    order, and with it every bit of the result, is the same on every run.
    """
    wanted = [p for p in params if p is not None]
    if M == 0:
        grads = [None if p is None else torch.zeros_like(p) for p in params]
        return grads[0] if len(grads) == 1 else tuple(grads)
    launcher = launcher_for(kernel, device, values)
    grid, rows = persistent_grid(launcher, M)
    # One workspace plane per wanted param; params of one dtype share a column-sum launch.
    device_of = wanted[0].device if wanted else None
    workspace = torch.empty((len(wanted), rows, N), dtype=torch.float32, device=device_of)
    stream = stream_of(device)
    tail = (M,) if layout is None else (M, *layout)
    launcher(grid, stream, *ptrs, *(plane.data_ptr() for plane in workspace), *tail)
    if not wanted:
        sums = iter(())
    elif len({p.dtype for p in wanted}) == 1:
        sums = iter(column_sum(workspace, wanted[0].dtype, device, stream))
    else:
        sums = iter(
            column_sum(plane[None], p.dtype, device, stream)[0]
            for plane, p in zip(workspace, wanted, strict=True)
        )
    grads = [None if p is None else next(sums) for p in params]
    return grads[0] if len(grads) == 1 else tuple(grads)
