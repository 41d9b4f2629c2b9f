"""Host cost of one kernel launch through cuda-bindings vs plain ctypes with prebuilt
arguments (no per-call conversion), at a tiny shape. Decides kbuild's launch path."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kbuild.jit import artifact_for, device_target  # noqa: E402
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec  # noqa: E402
from kbuild.runtime.cuda import Launcher  # noqa: E402
from kbuild.timing import host_us_per_call  # noqa: E402


def main() -> None:
    M, N = 4, 4096
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    launcher = Launcher(
        artifact_for(rmsnorm_fwd_spec(N, "bf16", "bf16", False, 1e-6), device_target(0)), 0
    )
    stream = torch._C._cuda_getCurrentRawStream(0)
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), M)
    print("bindings launcher us", host_us_per_call(lambda: launcher(M, stream, *args), 20000))
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    c_fn = ctypes.c_void_p(int(launcher._function))
    one, zero = ctypes.c_uint(1), ctypes.c_uint(0)
    block = ctypes.c_uint(launcher.block)
    c_stream = ctypes.c_void_p(stream)
    params = ctypes.c_void_p(launcher._params_address)
    null = ctypes.c_void_p(0)
    grids = {}
    pack, storage = launcher._pack, launcher._storage

    def ct(grid):
        g = grids.get(grid)
        if g is None:
            g = grids[grid] = ctypes.c_uint(grid)
        pack(storage, 0, *args)
        return fn(c_fn, g, one, one, block, one, one, zero, c_stream, params, null)

    print("ctypes prebuilt us", host_us_per_call(lambda: ct(M), 20000))
    torch.cuda.synchronize()
    ref = torch.nn.functional.rms_norm(x.float(), (N,), w.float(), 1e-6).to(x.dtype)
    y.zero_()
    assert ct(M) == 0
    torch.cuda.synchronize()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    print("ctypes launch result correct")


if __name__ == "__main__":
    main()
