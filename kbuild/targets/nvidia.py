"""NVIDIA lowering: gpu dialect -> NVVM -> PTX (MLIR) -> cubin (ptxas).

The PTX always comes out of MLIR; ptxas, when found, turns it into a cubin for the exact arch
and reports registers and spills. Without ptxas the PTX itself is the binary and the driver
JIT-compiles it at load (about 100 ms per kernel instead of 0.5 ms), so warmup wants ptxas.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile

from . import Target, ToolchainError, tool_from_env


@functools.cache
def ptxas_path() -> str | None:
    """`$KBUILD_PTXAS`, else ptxas on PATH, else the CUDA toolkit's; None when absent."""
    explicit = tool_from_env("KBUILD_PTXAS")
    if explicit:
        return explicit
    found = shutil.which("ptxas")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "ptxas")):
            return os.path.join(root, "bin", "ptxas")
    return None


@functools.cache
def ptxas_version() -> str:
    """`ptxas --version`'s release (e.g. "13.0.88"), or "none"."""
    path = ptxas_path()
    if path is None:
        return "none"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"V(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def module_to_ptx(module, target: Target) -> bytes:
    """Run the NVIDIA pipeline over a verified module; return the PTX of its gpu.module."""
    from mlir import passmanager
    from mlir.dialects import gpu

    with module.context:
        passmanager.PassManager.parse(target.pipeline).run(module.operation)
        for op in module.body.operations:
            if op.operation.name == "gpu.binary":
                return gpu.ObjectAttr(op.attributes["objects"][0]).object
    raise RuntimeError("the NVIDIA pipeline produced no gpu.binary")


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def ptx_to_cubin(ptx: bytes, arch: str) -> tuple[bytes, dict[str, int]]:
    """Assemble PTX for `arch` with ptxas -O3; return the cubin and its resource report."""
    path = ptxas_path()
    if path is None:
        raise ToolchainError("ptxas not found (set KBUILD_PTXAS or put CUDA's bin on PATH)")
    with tempfile.TemporaryDirectory(prefix="kbuild-ptxas-") as tmp:
        src, dst = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "wb") as f:
            f.write(ptx)
        proc = subprocess.run(
            [path, f"-arch={arch}", "-O3", "-v", src, "-o", dst],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed for {arch}:\n{proc.stderr.strip()}")
        with open(dst, "rb") as f:
            cubin = f.read()
    report = proc.stderr + proc.stdout
    regs, spills, stack = _REGISTERS.search(report), _SPILLS.search(report), _STACK.search(report)
    return cubin, {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_stores": int(spills.group(1)) if spills else 0,
        "spill_loads": int(spills.group(2)) if spills else 0,
        "stack_bytes": int(stack.group(1)) if stack else 0,
    }
