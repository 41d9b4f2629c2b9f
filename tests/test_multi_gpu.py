"""kbuild on more than one GPU: each device runs its own loaded module, one disk entry per arch
serves every device, and DistributedDataParallel training matches torch's norms.

On a machine with two or more GPUs, from the repository root, after warming the cache with
`kbuild warmup --arch sm_90 --manifest tests --cache-dir .kbuild-aot`:

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. python3 -m pytest -m multi_gpu tests/test_multi_gpu.py -q

The `gpu` tests at the end need one GPU: `-m gpu` runs them, `-m "gpu or multi_gpu"` the whole
file. Every kernel launched here is in `kbuild.cli.manifest.manifest("tests")`: N 768 (fp32) and
4096 (bf16), weights of x's dtype, eps 1e-6 for RMSNorm and the fused form and 1e-5 for
LayerNorm, and the DDP model at TRAIN_N fp32.
"""  # noqa: E501 (the command above is one line, to copy as is)

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import kbuild
from kbuild import jit
from kbuild.cache import DiskCache, default_cache_dir, entry_key
from kbuild.cases import TRAIN_DTYPE, TRAIN_N
from kbuild.cli.manifest import manifest
from kbuild.cli.widths import column_sum_spec
from kbuild.kernels.norms.rmsnorm import rmsnorm_bwd_spec, rmsnorm_fwd_spec
from kbuild.op.launch import rows_grid

from . import multi_gpu_worker
from .gpu_utils import GRAD_TOL
from .reference import assert_close_rel, layernorm_grads, rmsnorm_grads

M = 64
SHAPES = [(768, torch.float32), (4096, torch.bfloat16)]
KERNELS = {
    "rmsnorm": {"rmsnorm_fwd", "rmsnorm_bwd", "column_sum"},
    "layernorm": {"layernorm_fwd", "layernorm_bwd", "column_sum"},
    "fused_add_rmsnorm": {"fused_add_rmsnorm_fwd", "fused_add_rmsnorm_bwd", "column_sum"},
}


@pytest.fixture
def memory_tier():
    """kbuild's per-process tier of loaded kernels, emptied so a test sees only its own loads
    (forgetting a kernel only costs a reload from the disk cache)."""
    jit.forget_loaded()
    return jit._loaded


def _rand(shape, dtype: torch.dtype, seed: int, device: int, scale: float = 1.0) -> torch.Tensor:
    """The same values on every device: drawn on the CPU, then copied to cuda:`device`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=f"cuda:{device}", dtype=dtype)


def _param(N: int, dtype: torch.dtype, seed: int, device: int, offset: float) -> torch.Tensor:
    return (offset + _rand((N,), dtype, seed, device, scale=0.5)).requires_grad_()


def _cpu(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().cpu() for t in tensors]


# Each case makes inputs on cuda:`device`, runs one op forward (with and without autograd) and
# backward inside `call` (which may change the current device or the thread), and returns
# {name: (kbuild result, fp64 reference, tolerance)}.


def _direct(fn):
    return fn()


def _rmsnorm_case(device: int, N: int, dtype: torch.dtype, call=_direct) -> dict:
    x = _rand((M, N), dtype, 1, device).requires_grad_()
    w = _param(N, dtype, 2, device, 1.0)
    dy = _rand((M, N), dtype, 3, device)

    def kernels():
        y = kbuild.rmsnorm(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, [x, w], dy)
        with torch.no_grad():
            return y, kbuild.rmsnorm(x, w, 1e-6), dx, dw

    y, y_inference, dx, dw = call(kernels)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(*_cpu(x, w, dy), 1e-6)
    tol = GRAD_TOL[dtype]
    return {
        "y": (y, ref_y.to(dtype), tol),
        "y (no grad)": (y_inference, ref_y.to(dtype), tol),
        "dx": (dx, ref_dx, tol),
        "dw": (dw, ref_dw, 2 * tol),
    }


def _layernorm_case(device: int, N: int, dtype: torch.dtype, call=_direct) -> dict:
    x = _rand((M, N), dtype, 4, device, scale=2.0).requires_grad_()
    w, b = _param(N, dtype, 5, device, 1.0), _param(N, dtype, 6, device, 0.0)
    dy = _rand((M, N), dtype, 7, device)

    def kernels():
        y = kbuild.layernorm(x, w, b, 1e-5)
        dx, dw, db = torch.autograd.grad(y, [x, w, b], dy)
        with torch.no_grad():
            return y, kbuild.layernorm(x, w, b, 1e-5), dx, dw, db

    y, y_inference, dx, dw, db = call(kernels)
    ref_y, ref_dx, ref_dw, ref_db = layernorm_grads(*_cpu(x, w, b, dy), 1e-5)
    tol = GRAD_TOL[dtype]
    return {
        "y": (y, ref_y.to(dtype), tol),
        "y (no grad)": (y_inference, ref_y.to(dtype), tol),
        "dx": (dx, ref_dx, tol),
        "dw": (dw, ref_dw, 2 * tol),
        "db": (db, ref_db, 2 * tol),
    }


def _fused_case(device: int, N: int, dtype: torch.dtype, call=_direct) -> dict:
    x = _rand((M, N), dtype, 8, device).requires_grad_()
    r = _rand((M, N), dtype, 9, device).requires_grad_()
    w = _param(N, dtype, 10, device, 1.0)
    dy, dres = _rand((M, N), dtype, 11, device), _rand((M, N), dtype, 12, device)

    def kernels():
        out, res = kbuild.fused_add_rmsnorm(x, r, w, 1e-6)
        grads = torch.autograd.grad([out, res], [x, r, w], [dy, dres])
        with torch.no_grad():
            return out, res, *kbuild.fused_add_rmsnorm(x, r, w, 1e-6), *grads

    out, res, out_inference, res_inference, dx, dr, dw = call(kernels)
    x_cpu, r_cpu, w_cpu, dy_cpu, dres_cpu = _cpu(x, r, w, dy, dres)
    res_ref = (x_cpu.double() + r_cpu.double()).to(dtype)
    ref_out, ref_d, ref_dw, _ = rmsnorm_grads(res_ref, w_cpu, dy_cpu, 1e-6, dresidual_out=dres_cpu)
    tol = GRAD_TOL[dtype]
    return {
        "out": (out, ref_out.to(dtype), tol),
        "residual_out": (res, res_ref, 0.0),
        "out (no grad)": (out_inference, ref_out.to(dtype), tol),
        "residual_out (no grad)": (res_inference, res_ref, 0.0),
        "dx": (dx, ref_d, tol),
        "dresidual": (dr, ref_d, tol),
        "dw": (dw, ref_dw, 2 * tol),
    }


CASES = {"rmsnorm": _rmsnorm_case, "layernorm": _layernorm_case, "fused_add_rmsnorm": _fused_case}


def _check(results: dict, device: int, what: str) -> None:
    for name, (out, ref, tol) in results.items():
        where = f"{name} of {what} on cuda:{device}"
        assert out.device == torch.device("cuda", device), where
        if tol == 0.0:
            torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0, msg=where)
        else:
            assert_close_rel(out.cpu(), ref, tol, where)


@contextlib.contextmanager
def _current_device(index: int, how: str):
    """Make cuda:`index` the current device with a guard or with set_device (then restored)."""
    if how == "guard":
        with torch.cuda.device(index):
            yield
        return
    previous = torch.cuda.current_device()
    torch.cuda.set_device(index)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def _with_current(index: int, how: str):
    """A case's `call` that runs the kernels while cuda:`index` is the current device."""

    def call(fn):
        with _current_device(index, how):
            result = fn()
            assert torch.cuda.current_device() == index, "the op changed the current device"
        return result

    return call


def _launchers_by_device(tier) -> dict[tuple, dict[int, object]]:
    """{key without its device index: {device index: launcher}} over the loaded kernels."""
    found = defaultdict(dict)
    for key in tier.keys():
        found[key[:-1]][key[-1]] = tier.get(key)
    return found


# ----------------------------------------------------------------------------- two GPUs


@pytest.mark.multi_gpu
@pytest.mark.parametrize("how", ["guard", "set_device"])
@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("N, dtype", SHAPES, ids=["768-f32", "4096-bf16"])
@pytest.mark.parametrize("op", sorted(CASES))
def test_each_device_runs_its_own_module(op, N, dtype, first, how, memory_tier) -> None:
    """cuda:`first` then the other, each called while the *other* GPU is current."""
    outputs = {}
    for device in (first, 1 - first):
        results = CASES[op](device, N, dtype, call=_with_current(1 - device, how))
        _check(results, device, op)
        outputs[device] = {name: out.cpu() for name, (out, _, _) in results.items()}
    if torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1):
        # One binary, one launch shape (same SM count): the same bits on either device.
        for name in outputs[0]:
            assert torch.equal(outputs[0][name], outputs[1][name]), f"{name} differs by device"

    loaded = _launchers_by_device(memory_tier)
    assert {key[0] for key in loaded} == KERNELS[op]
    for key, launchers in loaded.items():
        assert sorted(launchers) == [0, 1], f"{key} loaded for devices {sorted(launchers)} only"
        assert launchers[0] is not launchers[1], f"{key}: one launcher serves both devices"
        assert (launchers[0].device_index, launchers[1].device_index) == (0, 1), key


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root` with its size and mtime: changes if anything is
    written, replaced or removed."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            stat = path.lstat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.mark.multi_gpu
def test_disk_cache_has_one_entry_per_arch_not_per_device(memory_tier, monkeypatch) -> None:
    targets = [jit.device_target(i) for i in (0, 1)]
    if targets[0] != targets[1]:
        pytest.skip(f"the GPUs differ in arch ({targets[0]} and {targets[1]})")
    root = default_cache_dir()
    before = _tree(root)
    monkeypatch.setenv("KBUILD_OFFLINE", "1")  # every load must come from the disk cache
    loads = defaultdict(list)
    real_artifact_for = jit.artifact_for

    def recording_artifact_for(spec, target, cache=None):
        artifact = real_artifact_for(spec, target, cache)
        loads[spec].append((target, artifact))
        return artifact

    monkeypatch.setattr(jit, "artifact_for", recording_artifact_for)
    for device in (0, 1):
        _check(_rmsnorm_case(device, 4096, torch.bfloat16), device, "rmsnorm")

    expected = {
        rmsnorm_fwd_spec(4096, "bf16", "bf16", True, 1e-6),
        rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6),
        rmsnorm_bwd_spec(4096, "bf16", "bf16", True),
        column_sum_spec(4096, "bf16"),
    }
    assert set(loads) == expected
    assert expected <= set(manifest("tests"))
    cache = DiskCache(root, read_only=True)
    for spec, uses in loads.items():
        assert [target for target, _ in uses] == targets, f"{spec.short()}: one load per device"
        keys = {entry_key(spec, target) for target in targets}
        assert len(keys) == 1, f"{spec.short()}: one entry key for both devices, got {keys}"
        stored = cache.get(keys.pop(), None)
        assert stored is not None
        assert all(artifact.binary == stored.binary for _, artifact in uses), spec.short()
    assert _tree(root) == before, "loading kernels changed the shared disk cache"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multi_gpu
def test_ddp_training_matches_torch_norms(tmp_path, monkeypatch) -> None:
    assert TRAIN_DTYPE == "f32" and TRAIN_N == 768  # the shapes the worker's model is built for
    for name, value in multi_gpu_worker.MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    kbuild_env = {k: v for k, v in os.environ.items() if k.startswith("KBUILD_")}
    world_size = 2
    torch.multiprocessing.spawn(
        multi_gpu_worker.train,
        args=(world_size, kbuild_env, str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    tol = dict(rtol=1e-4, atol=1e-5)
    for rank, result in enumerate(ranks):
        assert result["env"] == {**kbuild_env, **multi_gpu_worker.MULTICAST_OFF}, rank
        ours, theirs = result["kbuild"], result["torch"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], **tol, msg=f"rank {rank}")
        for kind in multi_gpu_worker.KINDS:
            # Every rank saw the same gradients after the all-reduce, at every step.
            assert all(all(step) for step in result[kind]["grads_equal"]), (kind, rank)
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, theirs["params"][name], **tol, msg=f"{name} {rank}")
            moved = (p - result["initial"][name]).abs().max().item()
            assert moved > 10 * tol["atol"], f"{name} barely trained ({moved:.1e})"
    # The ranks trained on different batches and still hold one model.
    assert ranks[0]["kbuild"]["losses"][0] != ranks[1]["kbuild"]["losses"][0]
    for kind in multi_gpu_worker.KINDS:
        for name, p in ranks[0][kind]["params"].items():
            assert torch.equal(p, ranks[1][kind]["params"][name]), (kind, name)


# ----------------------------------------------------------------------------- one GPU


@pytest.mark.gpu
def test_memory_tier_key_ends_with_device_index(memory_tier) -> None:
    _check(_rmsnorm_case(0, 768, torch.float32), 0, "rmsnorm")
    keys = memory_tier.keys()
    assert {key[0] for key in keys} == KERNELS["rmsnorm"]
    for key in keys:
        assert type(key[-1]) is int and key[-1] == 0, key
        assert memory_tier.get(key).device_index == 0, key


def _current_context() -> int:
    from cuda.bindings import driver

    err, context = driver.cuCtxGetCurrent()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return int(context)


def _in_fresh_thread(fn):
    """fn() in a new threading.Thread (no CUDA context current there yet): its result, the
    context current when it started, and the one current when it returned."""
    box = {}

    def body():
        try:
            box["before"] = _current_context()
            box["result"] = fn()
            box["after"] = _current_context()
        except BaseException as err:  # re-raised in the test's thread
            box["error"] = err

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"], box["before"], box["after"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(CASES))
def test_forward_backward_from_fresh_thread(op, memory_tier) -> None:
    """Load and launch from a thread that has never touched CUDA, under torch.cuda.device(0).

    The inputs are made here, so the kernels are the first CUDA work of the new thread: its
    first launch finds no current context and takes the Launcher's retry.
    """
    contexts = []

    def in_fresh_thread(fn):
        def under_device_0():
            with torch.cuda.device(0):
                return fn()

        result, before, _ = _in_fresh_thread(under_device_0)
        contexts.append(before)
        return result

    _check(CASES[op](0, 4096, torch.bfloat16, call=in_fresh_thread), 0, op)
    assert contexts == [0], "the thread started with a CUDA context: no retry was exercised"


@pytest.mark.gpu
def test_launch_without_context_binds_primary_context(memory_tier) -> None:
    """The Launcher's retry: a launch from a thread with no current context binds cuda:0's
    primary context (PyTorch's) and runs there."""
    from kbuild.runtime.cuda import _primary_context

    x = _rand((M, 4096), torch.bfloat16, 13, 0)
    w = _rand((4096,), torch.bfloat16, 14, 0)
    with torch.no_grad():
        expected = kbuild.rmsnorm(x, w, 1e-6)
    (key,) = memory_tier.keys()
    launcher = memory_tier.get(key)
    y = torch.full_like(x, float("nan"))
    stream = torch.cuda.current_stream(0).cuda_stream
    torch.cuda.synchronize(0)
    grid = rows_grid(launcher, M)
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), M)
    _, before, after = _in_fresh_thread(lambda: launcher(grid, stream, *args))
    torch.cuda.synchronize(0)
    assert before == 0
    assert after == int(_primary_context(0))
    assert torch.equal(y, expected)
