import torch, time, kbuild, torch.nn.functional as F
from kbuild.timing import median_ms, copy_gbps, host_us_per_call
from kbuild.jit import artifact_for, device_target
from kbuild.ops.rmsnorm import rmsnorm_fwd_spec
from kbuild.runtime.cuda import Launcher
import triton.testing as tt
copy = copy_gbps(); print("copy", copy)
for N in (1024, 4096, 8192, 65536):
    M = 64*2**20//N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16); w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    nb = 2*x.numel()*2
    ms = median_ms(lambda: kbuild.rmsnorm(x, w)); ms2 = tt.do_bench(lambda: kbuild.rmsnorm(x, w), return_mode="median")
    me = median_ms(lambda: F.rms_norm(x, (N,), w, 1e-6))
    print(N, f"kbuild {nb/ms/1e6:.0f} (do_bench {nb/ms2/1e6:.0f}) eager {nb/me/1e6:.0f} GB/s")
M,N=4,4096
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16); w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
y=torch.empty_like(x)
l = Launcher(artifact_for(rmsnorm_fwd_spec(N,"bf16","bf16",False,1e-6), device_target(0)), 0)
xp,wp,yp=x.data_ptr(),w.data_ptr(),y.data_ptr()
s=torch._C._cuda_getCurrentRawStream(0)
print("ctypes launch us", host_us_per_call(lambda: l(M, s, xp, wp, yp, M), 20000))
from cuda.bindings import driver
import ctypes
params=(ctypes.c_void_p*4)(*[ctypes.addressof(v) for v in l._storage]); pa=ctypes.addressof(params)
f=l._function
print("bindings launch us", host_us_per_call(lambda: driver.cuLaunchKernel(f, M,1,1,l.block,1,1,0,s,pa,0), 20000))
print("kbuild.rmsnorm us", host_us_per_call(lambda: kbuild.rmsnorm(x, w), 20000))
print("F.rms_norm us", host_us_per_call(lambda: F.rms_norm(x, (N,), w, 1e-6), 20000))
print("empty_like us", host_us_per_call(lambda: torch.empty_like(x), 20000))
torch.testing.assert_close(kbuild.rmsnorm(x,w), F.rms_norm(x.float(),(N,),w.float(),1e-6).to(x.dtype), rtol=2e-2, atol=2e-2)
