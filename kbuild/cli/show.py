"""What a kernel became: its MLIR, the lowered LLVM (dialect, or IR for AMD), PTX or AMDGPU
assembly, and SASS. Behind `kbuild show` and `KBUILD_DUMP_DIR`.

    kbuild show 'rmsnorm_fwd(N=4096, dtype=bf16, eps=1e-06, store_rstd=True, vectorize=True,
                 weight_dtype=bf16)' --ptx
    kbuild show '{"kernel": "rmsnorm_fwd", "params": {...}}' --mlir --arch gfx942

A spec is given as JSON or as the one-line label warmup prints (paste a warmup line's label).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..spec import KernelSpec

STAGES = ("mlir", "llvm", "ptx", "asm", "sass")


def parse_spec(text: str) -> KernelSpec:
    """A spec from its JSON or its `name(key=value, ...)` label; ValueError otherwise."""
    from ..registry import kernel_def

    text = text.strip()
    if text.startswith("{"):
        try:
            spec = KernelSpec.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not a kernel spec: {err}") from None
        kernel_def(spec.kernel).spec(**spec.kwargs)  # values its table entry takes
        return spec
    match = re.fullmatch(r"(\w+)\((.*)\)", text, re.S)
    if match is None:
        raise ValueError(f"a spec is JSON or name(key=value, ...), not {text!r}")
    params = {}
    for item in filter(None, (p.strip() for p in match.group(2).split(","))):
        key, _, value = item.partition("=")
        try:
            params[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            params[key.strip()] = value.strip()  # bare words: dtype names
    return kernel_def(match.group(1)).spec(**params)


def stages(spec: KernelSpec, arch: str, wanted: tuple[str, ...]) -> dict[str, str]:
    """{stage: text} for the stages asked for (see STAGES). A stage the target does not have
    (PTX or SASS for AMD) raises ValueError; one this machine cannot make (SASS without ptxas
    and cuobjdump or nvdisasm) raises ToolchainError."""
    from .. import compiler
    from ..targets import target_for_arch

    target = target_for_arch(arch)
    foreign = [s for s in wanted if s in ("ptx", "sass") and target.vendor == "amd"]
    if foreign:
        raise ValueError(f"--{foreign[0]} is NVIDIA's; for {arch} ask for --asm (or --llvm)")
    out: dict[str, str] = {}
    kernel = compiler.build(spec, target)
    if "mlir" in wanted:
        with kernel.context:
            out["mlir"] = str(kernel.module)
    lowered = compiler._lowered(kernel, spec, target)
    if target.vendor == "amd":
        from ..targets import amd

        ir_text = amd.module_to_llvm_ir(lowered)
        if "llvm" in wanted:
            out["llvm"] = ir_text
        if "asm" in wanted:
            out["asm"] = amd.llvm_ir_to_assembly(ir_text, arch)
        return out
    if "llvm" in wanted:
        out["llvm"] = lowered
    from ..targets.nvidia import module_to_ptx

    ptx = module_to_ptx(compiler.build(spec, target).module, target)  # a fresh module
    if "ptx" in wanted or "asm" in wanted:
        out["ptx" if "ptx" in wanted else "asm"] = ptx.decode().rstrip("\0")
    if "sass" in wanted:
        out["sass"] = _sass(ptx, arch)
    return out


def _sass(ptx: bytes, arch: str) -> str:
    from ..targets import ToolchainError
    from ..targets.nvidia import ptx_to_cubin, ptxas_path

    tool = shutil.which("cuobjdump") or shutil.which("nvdisasm")
    if ptxas_path() is None or tool is None:
        raise ToolchainError("--sass needs ptxas and cuobjdump or nvdisasm on PATH")
    cubin, _ = ptx_to_cubin(ptx, arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        flag = ["--dump-sass"] if tool.endswith("cuobjdump") else []
        result = subprocess.run([tool, *flag, str(path)], capture_output=True, text=True)
        return result.stdout or result.stderr
