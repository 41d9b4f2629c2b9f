"""The C++ extension is built and loaded at the first CUDA call, never by a CPU-only process.

Each check runs in a fresh process (a load cannot be undone in this one): importing kbuild and
running every op on CPU tensors compiles nothing; the first CUDA kernel reached through the
dispatcher (a torch.ops.kbuild.* call, as a compiled graph makes) loads it, and then the
extension's kernels are the operators' only CUDA and Autograd kernels (the Python ones taken
away first, so torch warns of no kernel replaced), and ops declared before the load run its
generic kernels; a public function's first CUDA call loads it too, and CPU calls never do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

# not_interpreted: KBUILD_INTERPRET turns the extension off (the Python launch path runs)
pytestmark = pytest.mark.not_interpreted
NO_COMPILER = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler to build it"
)


def _run(script: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


CPU_WORK = """
import torch
import kbuild
from kbuild import native
from kbuild.kernels.norms import api

x = torch.randn(4, 64, requires_grad=True)
w = torch.ones(64, requires_grad=True)
b = torch.zeros(64, requires_grad=True)
y = kbuild.rmsnorm(x, w) + kbuild.layernorm(x, w, b) + kbuild.rmsnorm(x, w, offset=1.0)
out, res = kbuild.fused_add_rmsnorm(x, x.detach(), w)
y = y + out + kbuild.linear(x, torch.randn(64, 64), b)
tokens = torch.randint(0, 256, (2, 2))
emb = kbuild.encoder(tokens, torch.randn(256, 64, requires_grad=True),
                     torch.randn(8, 64, requires_grad=True))
(y.sum() + res.sum() + emb.sum() + kbuild.bias_grad(torch.randn(3, 64)).sum()).backward()
torch.ops.kbuild.rmsnorm_fwd(x, w, 1e-6, True)[0].sum().backward()
torch.ops.kbuild.layernorm_fwd(x, w, b, 1e-5, True)[0].sum().backward()
print("cuda", torch.cuda.is_available())
print("wanted", native.load())  # not forced: where CUDA is unavailable, None and no build
print("loaded", native.loaded(), type(api._native).__name__)
"""


def test_a_cpu_process_never_builds_the_extension(subprocess_env, tmp_path):
    """Catches a load at import (the extension used to be built by `import kbuild`: a minute
    on 2 cores for a path only CUDA uses) or one by a CPU call (a public function, the
    autograd, a torch.ops.kbuild.* call, the llm.c ops): the compiler is one that records
    each call, the library folder a fresh one."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "recording-cxx"
    cxx.write_text(f"#!/bin/sh\necho called >> {calls}\nexit 1\n")
    cxx.chmod(0o755)
    folder = tmp_path / "native"
    env = {**subprocess_env, "CXX": str(cxx), "KBUILD_NATIVE_DIR": str(folder)}
    env.pop("KBUILD_NATIVE", None)
    out = _run(CPU_WORK, env).stdout
    if "cuda True" in out:  # a GPU machine: load() wants it there (the CPU work still did not)
        assert "wanted None" in out and calls.exists()
        return
    assert "wanted None" in out and "loaded None _Unloaded" in out, out
    assert not calls.exists(), calls.read_text()
    assert not folder.exists()


FIRST_CUDA_KERNEL = """
import torch
from kbuild import native
from kbuild.kernels.llmc import op as llmc_op  # noqa: F401 (declares kbuild::bias_grad)
from kbuild.kernels.norms import api
from kbuild.op import opdef
from tests.examples import import_example

example = import_example()  # declared before the load: the Python kernels, upgraded at it
print("before", example.softmax.generic_native, example.softmax.native_autograd)
torch.cuda.is_available = lambda: True  # as on a GPU machine

# An op whose CUDA kernel the extension would provide (native=True), a stand-in doing 2 * x:
# its Python kernel is what runs until the extension loads, and its first call loads it.
twice = opdef.Op("kbuild_lazy_test::twice", args=(opdef.Rows("x"),),
                 outputs=(opdef.Out("y", like="x"),), reference=lambda x: 2 * x,
                 cuda=lambda x: 2 * x, native=True)
opdef.STANDIN.register_until_native(twice)
x = torch.randn(2, 8)
print("unloaded", native.loaded() is None)
cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
y = twice.overload.redispatch(cuda, x)  # the dispatcher's CUDA kernel, as for a CUDA tensor
print("loaded", native.loaded() is not None, "value", torch.equal(y, 2 * x))
print("after", example.softmax.generic_native, example.softmax.native_autograd)
print("api", api._native is native.loaded(), opdef.NATIVE[0] is native.loaded())
for name in ("kbuild::rmsnorm_fwd", "kbuild::bias_grad", "user_softmax::softmax"):
    print(torch._C._dispatch_dump(name))
"""


@NO_COMPILER
def test_the_first_cuda_kernel_call_loads_the_extension(subprocess_env):
    """Catches: a torch.ops.kbuild.* call on CUDA that never loads the extension (a compiled
    graph calls the operators directly, not the public functions), or one that finds no CUDA
    kernel before it loads; a Python kernel left registered under the extension's (torch
    warns "Overriding a previously registered kernel", and the old one shows as inactive); an
    op declared before the load left on the Python launch path (the worked example declares
    its op at import, before any CUDA call); the public entries not switched to the C++
    ones."""
    env = {k: v for k, v in subprocess_env.items() if k != "KBUILD_NATIVE"}
    result = _run(FIRST_CUDA_KERNEL, env)
    out = result.stdout
    assert "before False False" in out and "unloaded True" in out, out
    assert "loaded True value True" in out, out
    assert "after True True" in out and "api True True" in out, out
    dumps = out.split("name: ")[1:]
    rmsnorm, bias_grad, softmax = dumps
    assert "CUDA: registered at " in rmsnorm and "kbuild_native.cpp" in rmsnorm
    assert "Autograd[alias]: registered at " in rmsnorm
    assert "CUDA: registered at " in bias_grad and "kbuild_native.cpp" in bias_grad
    assert "generic.h" in softmax.split("CUDA: ")[1].splitlines()[0], softmax
    assert "inactive" not in out, out
    assert "Overriding a previously registered kernel" not in result.stderr, result.stderr


PUBLIC_ENTRY = """
import torch
from kbuild import native
from kbuild.kernels.norms import api

unloaded = api._native
x = torch.randn(2, 8)
print("cpu", unloaded.rmsnorm(x, None, 1e-6, None), native.loaded() is None)


class Cuda(torch.Tensor):  # a tensor that says it is on CUDA (the entries decline subclasses)
    is_cuda = property(lambda self: True)


torch.cuda.is_available = lambda: True
fake = torch.Tensor._make_subclass(Cuda, x)
print("cuda", unloaded.rmsnorm(fake, None, 1e-6, None), native.loaded() is not None)
print("bound", api._native is native.loaded())
"""


@NO_COMPILER
def test_a_public_function_given_a_cuda_tensor_loads_it(subprocess_env):
    """Catches a public entry that loads the extension for a CPU tensor (a CPU-only process
    would build it), or one that never loads it for a CUDA tensor (the eager hot path would
    stay Python), or leaves `api._native` the stand-in (every call paying its detour)."""
    env = {k: v for k, v in subprocess_env.items() if k != "KBUILD_NATIVE"}
    out = _run(PUBLIC_ENTRY, env).stdout
    assert "cpu None True" in out, out
    assert "cuda None True" in out and "bound True" in out, out


def test_disabled_settles_at_import(subprocess_env):
    """KBUILD_NATIVE=0: the Python launch path from import on, the first CUDA call included
    (catches a CUDA call that builds it anyway)."""
    script = PUBLIC_ENTRY.replace("unloaded = api._native", "unloaded = api._Unloaded()")
    env = {**subprocess_env, "KBUILD_NATIVE": "0"}
    out = _run(script + "print('native', api._native)\n", env).stdout
    assert "cuda None False" in out and "native None" in out, out
