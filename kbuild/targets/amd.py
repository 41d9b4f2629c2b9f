"""AMD: lowered ROCDL module -> LLVM IR -> AMDGPU object (llvmlite) -> HSACO (ld.lld), and
what the code object says about the kernel (its AMDGPU metadata note).

The MLIR bindings carry no AMDGPU backend, so `gpu-module-to-binary` cannot run for a
`#rocdl.target`. Instead the `llvm.*` ops of the lowered `gpu.module` are cloned into a plain
module with the amdgcn-amd-amdhsa triple, translated to LLVM IR in process, compiled by
llvmlite's LLVM (which has the AMDGPU backend) and linked into a shared code object by LLD
(the `ziglang` wheel's, or ROCm's own where installed). Code object v5, as ROCm 6 loads.

The pieces come from the `amd` extra (`pip install kbuild[amd]`: llvmlite, ziglang); their
versions are part of the cache key's toolchain (`toolchain_versions`). Kernel attributes AMD
code generation needs are set by the lowering: `amdgpu-flat-work-group-size` from the block
the kernel is launched with (else LLVM plans for 1024 threads and starves it of VGPRs);
wave64 is the default on CDNA (gfx9), which is all `targets._AMD_WAVE` builds for wave64.

No torch, no device: everything here runs on a CPU machine.
"""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from importlib import metadata

from . import ToolchainError, tool_from_env

TRIPLE = "amdgcn-amd-amdhsa"
CODE_OBJECT_VERSION = 5
EM_AMDGPU = 224
ELFOSABI_AMDGPU_HSA = 64
ABI_VERSION = {4: 2, 5: 3, 6: 4}  # code object version -> e_ident[EI_ABIVERSION]
# e_flags & 0xff (EF_AMDGPU_MACH) per arch, from LLVM's ELF.h
MACH = {"gfx90a": 0x03F, "gfx942": 0x04C, "gfx950": 0x04F, "gfx1100": 0x041, "gfx1201": 0x04E}
NT_AMDGPU_METADATA = 32


class AmdToolchainMissing(ToolchainError):
    """llvmlite or an ld.lld is not installed (`pip install kbuild[amd]`)."""


# ----------------------------------------------------------------------------- toolchain


def _lld() -> list[str]:
    """The ld.lld command: $KBUILD_LLD, ROCm's own, else the ziglang wheel's."""
    explicit = tool_from_env("KBUILD_LLD")
    if explicit:
        return [explicit]
    rocm = os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "llvm", "bin", "ld.lld")
    if os.path.exists(rocm):
        return [rocm]
    try:
        metadata.version("ziglang")
    except metadata.PackageNotFoundError:
        found = shutil.which("ld.lld")
        if found is None:
            raise AmdToolchainMissing(
                "no ld.lld for AMD code objects: pip install 'kbuild[amd]' (the ziglang wheel "
                "carries LLD), or set KBUILD_LLD"
            ) from None
        return [found]
    return [sys.executable, "-m", "ziglang", "ld.lld"]


@functools.cache
def toolchain_versions() -> dict[str, str]:
    """What shapes an AMD binary besides the MLIR wheels: llvmlite's LLVM and the LLD."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    tools = {"llvmlite": version("llvmlite")}
    try:
        import llvmlite.binding as lb

        tools["llvmlite_llvm"] = ".".join(map(str, lb.llvm_version_info))
    except ImportError:
        pass
    try:
        out = subprocess.run([*_lld(), "--version"], capture_output=True, text=True, timeout=60)
        tools["lld"] = out.stdout.strip().splitlines()[0] if out.stdout else "unknown"
    except (AmdToolchainMissing, OSError, subprocess.SubprocessError):
        tools["lld"] = "none"
    return tools


# ----------------------------------------------------------------------------- emit + link


def module_to_llvm_ir(lowered_text: str) -> str:
    """The lowered MLIR (a gpu.module of llvm.* ops) as LLVM IR for the amdgcn triple, asking
    for code object v5."""
    from mlir import ir
    from mlir.dialects import llvm

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(lowered_text)
        gpu_module = next(op for op in module.body.operations if op.name == "gpu.module")
        plain = ir.Module.create()
        plain.operation.attributes["llvm.target_triple"] = ir.StringAttr.get(TRIPLE)
        plain.operation.attributes["llvm.data_layout"] = gpu_module.attributes["llvm.data_layout"]
        at = ir.InsertionPoint(plain.body)
        for op in gpu_module.regions[0].blocks[0].operations:
            op.clone(at)
        text = str(llvm.translate_module_to_llvmir(plain.operation))
    flag = f'!9000 = !{{i32 1, !"amdhsa_code_object_version", i32 {CODE_OBJECT_VERSION * 100}}}'
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if line.startswith("!llvm.module.flags = !{"):  # the translation's (debug info version)
            lines[k] = line[:-1] + ", !9000}"
            break
    else:
        lines.append("!llvm.module.flags = !{!9000}")
    return "\n".join([*lines, flag, ""])


def llvm_ir_to_hsaco(ir_text: str, arch: str) -> bytes:
    """Compile LLVM IR for `arch` (llvmlite, O3) and link it into a loadable code object."""
    try:
        import llvmlite.binding as lb
    except ImportError:
        raise AmdToolchainMissing(
            "AMD code objects need llvmlite: pip install 'kbuild[amd]'"
        ) from None
    _init_llvm()
    module = lb.parse_assembly(ir_text)  # parsed afresh per emit (a reused one can crash)
    module.verify()
    machine = lb.Target.from_triple(TRIPLE).create_target_machine(cpu=arch, opt=3, reloc="pic")
    obj = machine.emit_object(module)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.hsaco")
        with open(src, "wb") as f:
            f.write(obj)
        result = subprocess.run(
            [*_lld(), "-shared", "-o", out, src], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"ld.lld failed: {result.stderr.strip()[-2000:]}")
        with open(out, "rb") as f:
            return f.read()


def llvm_ir_to_assembly(ir_text: str, arch: str) -> str:
    """The AMDGPU assembly of LLVM IR for `arch` (what `kbuild show --asm` prints)."""
    import llvmlite.binding as lb

    _init_llvm()
    module = lb.parse_assembly(ir_text)
    machine = lb.Target.from_triple(TRIPLE).create_target_machine(cpu=arch, opt=3, reloc="pic")
    return machine.emit_assembly(module)


@functools.cache
def _init_llvm() -> None:
    import llvmlite.binding as lb

    lb.initialize_all_targets()
    lb.initialize_all_asmprinters()


# ----------------------------------------------------------------------------- reading it


def read_msgpack(data: bytes):
    """The one msgpack value at the start of `data` (the AMDGPU metadata note's encoding)."""
    value, _ = _unpack(data, 0)
    return value


def _unpack(b: bytes, i: int):  # noqa: C901 - one branch per msgpack type, as the spec lists
    t = b[i]
    i += 1
    if t <= 0x7F:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if 0x80 <= t <= 0x8F:
        return _map(b, i, t & 0x0F)
    if 0x90 <= t <= 0x9F:
        return _array(b, i, t & 0x0F)
    if 0xA0 <= t <= 0xBF:
        n = t & 0x1F
        return b[i : i + n].decode(), i + n
    fixed = {0xC0: None, 0xC2: False, 0xC3: True}
    if t in fixed:
        return fixed[t], i
    sized = {0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: "b", 0xD1: ">h", 0xD2: ">i"}
    sized.update({0xD3: ">q", 0xCA: ">f", 0xCB: ">d"})
    if t in sized:
        fmt = sized[t]
        return struct.unpack_from(fmt, b, i)[0], i + struct.calcsize(fmt)
    lengths = {0xD9: "B", 0xDA: ">H", 0xDB: ">I", 0xC4: "B", 0xC5: ">H", 0xC6: ">I"}
    if t in lengths:
        n = struct.unpack_from(lengths[t], b, i)[0]
        i += struct.calcsize(lengths[t])
        raw = b[i : i + n]
        return (raw.decode() if t >= 0xD9 else bytes(raw)), i + n
    if t in (0xDC, 0xDD, 0xDE, 0xDF):
        fmt = ">H" if t in (0xDC, 0xDE) else ">I"
        n = struct.unpack_from(fmt, b, i)[0]
        i += struct.calcsize(fmt)
        return (_array if t in (0xDC, 0xDD) else _map)(b, i, n)
    raise ValueError(f"msgpack type 0x{t:02x} at byte {i - 1} is not one the metadata uses")


def _array(b, i, n):
    out = []
    for _ in range(n):
        v, i = _unpack(b, i)
        out.append(v)
    return out, i


def _map(b, i, n):
    out = {}
    for _ in range(n):
        k, i = _unpack(b, i)
        v, i = _unpack(b, i)
        out[k] = v
    return out, i


def read_code_object(binary: bytes) -> dict:
    """The ELF facts of an AMDGPU code object: machine, OS ABI and its version (code object
    version), e_flags, the symbols (kernel descriptors end in .kd) and the metadata note."""
    if binary[:4] != b"\x7fELF" or binary[4] != 2 or binary[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_machine, _, _, _, e_shoff, e_flags = struct.unpack_from("<HIQQQI", binary, 18)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", binary, 58)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", binary, e_shoff + k * e_shentsize) for k in range(e_shnum)
    ]  # name, type, flags, addr, offset, size, link, info, align, entsize
    metadata_note, symbols = None, []
    for _name, kind, _f, _a, offset, size, link, _i, _al, entsize in sections:
        if kind == 7:  # SHT_NOTE
            pos, end = offset, offset + size
            while pos < end:
                namesz, descsz, ntype = struct.unpack_from("<III", binary, pos)
                pos += 12
                name = binary[pos : pos + namesz].rstrip(b"\0")
                pos += (namesz + 3) & ~3
                desc = binary[pos : pos + descsz]
                pos += (descsz + 3) & ~3
                if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                    metadata_note = read_msgpack(desc)
        if kind in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM: names from the linked string table
            strtab = sections[link]
            for k in range(size // entsize):
                st_name = struct.unpack_from("<I", binary, offset + k * entsize)[0]
                start = strtab[4] + st_name
                symbols.append(binary[start : binary.index(b"\0", start)].decode())
    return {
        "machine": e_machine,
        "osabi": binary[7],
        "abi_version": binary[8],
        "e_flags": e_flags,
        "symbols": sorted(set(filter(None, symbols))),
        "metadata": metadata_note,
    }


def kernel_resources(binary: bytes, entry: str) -> dict:
    """What `kbuild warmup` prints for an AMD kernel, as ptxas -v does for NVIDIA: registers,
    LDS, scratch (AMD's spill signal), wave size, work-group limit and the kernarg layout."""
    facts = read_code_object(binary)
    kernels = (facts["metadata"] or {}).get("amdhsa.kernels", [])
    mine = next((k for k in kernels if k.get(".name") == entry), None)
    if mine is None:
        raise ValueError(f"the code object has no metadata for kernel {entry!r}")
    return {
        "vgprs": mine.get(".vgpr_count"),
        "sgprs": mine.get(".sgpr_count"),
        "agprs": mine.get(".agpr_count", 0),
        "lds_bytes": mine.get(".group_segment_fixed_size"),
        "scratch_bytes": mine.get(".private_segment_fixed_size"),
        "vgpr_spills": mine.get(".vgpr_spill_count", 0),
        "sgpr_spills": mine.get(".sgpr_spill_count", 0),
        "wavefront_size": mine.get(".wavefront_size"),
        "max_flat_workgroup_size": mine.get(".max_flat_workgroup_size"),
        "kernarg_size": mine.get(".kernarg_segment_size"),
        "kernargs": [
            {"offset": a[".offset"], "size": a[".size"], "kind": a[".value_kind"]}
            for a in mine.get(".args", [])
        ],
    }


def check_code_object(binary: bytes, arch: str, entry: str, signature) -> None:
    """Raise ValueError unless `binary` is a loadable code object v5 for `arch` holding
    `entry`'s descriptor, with the explicit kernel arguments `signature` ((name, kind), the
    launcher's packing order: ptr and i64 both 8 bytes, back to back) at the offsets and
    sizes the metadata gives."""
    facts = read_code_object(binary)
    problems = []
    if facts["machine"] != EM_AMDGPU:
        problems.append(f"e_machine {facts['machine']} (EM_AMDGPU is {EM_AMDGPU})")
    if facts["osabi"] != ELFOSABI_AMDGPU_HSA:
        problems.append(f"OS ABI {facts['osabi']}, not AMDGPU_HSA")
    if facts["abi_version"] != ABI_VERSION[CODE_OBJECT_VERSION]:
        problems.append(f"ABI version {facts['abi_version']}: not code object v5")
    if facts["e_flags"] & 0xFF != MACH[arch]:
        mach = facts["e_flags"] & 0xFF
        problems.append(f"e_flags machine 0x{mach:03x}, {arch} is 0x{MACH[arch]:03x}")
    if f"{entry}.kd" not in facts["symbols"]:
        problems.append(f"no kernel descriptor {entry}.kd")
    if not problems:
        args = [a for a in kernel_resources(binary, entry)["kernargs"]]
        explicit = [a for a in args if not a["kind"].startswith("hidden_")]
        expected = [
            {"offset": 8 * k, "size": 8, "kind": "global_buffer" if kind == "ptr" else "by_value"}
            for k, (_, kind) in enumerate(signature)
        ]
        if explicit != expected:
            problems.append(f"kernargs {explicit} are not the signature's {expected}")
    if problems:
        raise ValueError(f"{entry} for {arch}: " + "; ".join(problems))
