"""AMD code objects built and checked on CPU: HSACO from the ROCDL lowering, the code object's
facts and metadata, and the HIP runtime's load and launch sequence against a fake libamdhip64.

What this catches: a kernel that does not compile for gfx942/gfx950 (an NVIDIA-only construct,
an LDS budget past the target's), a code object the ROCm loader would refuse (wrong machine,
e_flags, code object version, no kernel descriptor), a kernarg layout that is not the one the
launcher packs (offsets, sizes, kinds), scratch (spills) in the bench set, a launcher that
packs arguments in the wrong slots or launches the wrong function, grid, block or stream.
The AMD runtime has not run on an AMD GPU here.
"""

from __future__ import annotations

import ctypes
import re
import struct

import pytest

pytest.importorskip("llvmlite")

from kbuild import cli, compiler  # noqa: E402
from kbuild.artifact import Artifact  # noqa: E402
from kbuild.cache import DiskCache  # noqa: E402
from kbuild.cli.manifest import manifest  # noqa: E402
from kbuild.kernels.norms.kernels import LAYERNORM_BWD, RMSNORM_BWD, RMSNORM_FWD  # noqa: E402
from kbuild.runtime import hip  # noqa: E402
from kbuild.targets import amd, target_for_arch  # noqa: E402

ARCHES = ("gfx942", "gfx950")
SPECS = {
    "rmsnorm_fwd": RMSNORM_FWD.spec(4096, "bf16", "bf16", True, 1e-6),
    "rmsnorm_bwd": RMSNORM_BWD.spec(4096, "bf16", "bf16", True),
    "layernorm_bwd": LAYERNORM_BWD.spec(65536, "bf16", "bf16", True, True),
}


@pytest.fixture(scope="module")
def artifacts():
    return {
        (arch, name): compiler.compile_kernel(spec, target_for_arch(arch))
        for arch in ARCHES
        for name, spec in SPECS.items()
    }


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", SPECS)
def test_code_object_is_loadable_v5_for_its_arch(artifacts, arch, name):
    art = artifacts[arch, name]
    facts = amd.read_code_object(art.binary)
    assert art.format == "hsaco"
    assert facts["machine"] == amd.EM_AMDGPU == 224
    assert facts["osabi"] == 64 and facts["abi_version"] == 3  # HSA, code object v5
    assert facts["e_flags"] & 0xFF == amd.MACH[arch]
    assert f"{art.entry}.kd" in facts["symbols"]
    meta = art.meta
    assert meta["wavefront_size"] == 64  # CDNA: wave64
    assert meta["max_flat_workgroup_size"] == meta["block"]  # launched with exactly that
    assert meta["scratch_bytes"] == 0 and meta["vgpr_spills"] == 0
    assert (
        0 < meta["vgprs"] <= 512
        and meta["lds_bytes"] <= target_for_arch(arch).shared_bytes_per_block
    )
    explicit = [a for a in meta["kernargs"] if not a["kind"].startswith("hidden_")]
    assert [(a["offset"], a["size"]) for a in explicit] == [
        (8 * k, 8) for k in range(len(meta["signature"]))
    ]
    assert [a["kind"] for a in explicit] == [
        "global_buffer" if kind == "ptr" else "by_value" for _, kind in meta["signature"]
    ]


def test_check_code_object_refuses_what_the_loader_would(artifacts):
    art = artifacts["gfx942", "rmsnorm_fwd"]
    sig = art.meta["signature"]
    amd.check_code_object(art.binary, "gfx942", art.entry, sig)
    with pytest.raises(ValueError, match="e_flags machine 0x04c, gfx950 is 0x04f"):
        amd.check_code_object(art.binary, "gfx950", art.entry, sig)
    with pytest.raises(ValueError, match="no kernel descriptor other.kd"):
        amd.check_code_object(art.binary, "gfx942", "other", sig)
    with pytest.raises(ValueError, match="kernargs"):  # one argument short of the signature
        amd.check_code_object(art.binary, "gfx942", art.entry, sig[:-1])
    v4 = bytearray(art.binary)
    v4[8] = 2
    with pytest.raises(ValueError, match="not code object v5"):
        amd.check_code_object(bytes(v4), "gfx942", art.entry, sig)


def _kernarg_offsets_moved(binary: bytes, moves: dict[int, int]) -> bytes:
    """`binary` with its metadata's kernarg offsets rewritten in place: `moves` maps an
    argument's index (in the metadata's order) to its new offset. Old and new offsets are
    msgpack fixints (one byte), so the ELF around the note stays as it was."""
    out = bytearray(binary)
    found = [m.end() for m in re.finditer(re.escape(b"\xa7.offset"), binary)]
    for k, offset in moves.items():
        assert out[found[k]] < 0x80 and 0 <= offset < 0x80
        out[found[k]] = offset
    return bytes(out)


def test_kernarg_offsets_other_than_the_launchers_are_refused(artifacts, monkeypatch):
    """Catches a code-object check that no longer compares kernarg offsets (sizes and kinds
    alone): a kernel whose metadata puts arguments elsewhere than the launcher packs them
    (x and weight swapped, M moved past a gap) would read the wrong pointers and sizes."""
    art = artifacts["gfx942", "rmsnorm_fwd"]
    sig = art.meta["signature"]
    packed = [8 * k for k in range(len(sig))]
    for moves in ({0: 8, 1: 0}, {len(sig) - 1: 8 * len(sig)}):
        bad = _kernarg_offsets_moved(art.binary, moves)
        kernargs = amd.kernel_resources(bad, art.entry)["kernargs"]
        offsets = [a["offset"] for a in kernargs[: len(sig)]]
        assert offsets == [moves.get(k, o) for k, o in enumerate(packed)]  # the edit took
        assert [a["kind"] for a in kernargs[: len(sig)]] == [
            "global_buffer" if kind == "ptr" else "by_value" for _, kind in sig
        ]  # sizes and kinds as the launcher packs: only the offsets differ
        with pytest.raises(ValueError, match="kernargs"):
            amd.check_code_object(bad, "gfx942", art.entry, sig)
    # compile_kernel checks what it assembled: such a code object is a CompileError
    assemble = amd.llvm_ir_to_hsaco
    monkeypatch.setattr(
        amd,
        "llvm_ir_to_hsaco",
        lambda ir, arch: _kernarg_offsets_moved(assemble(ir, arch), {0: 8, 1: 0}),
    )
    with pytest.raises(compiler.CompileError, match="kernargs"):
        compiler.compile_kernel(SPECS["rmsnorm_fwd"], target_for_arch("gfx942"))


def test_msgpack_reader():
    blob = bytes([0x83, 0xA1, ord("a"), 0x01, 0xA1, ord("b"), 0x92, 0xC3, 0xD0, 0xFB])
    blob += bytes([0xA1, ord("c"), 0xCD, 0x01, 0x00])
    assert amd.read_msgpack(blob) == {"a": 1, "b": [True, -5], "c": 256}
    assert amd.read_msgpack(b"\xcb" + struct.pack(">d", 2.5)) == 2.5
    assert amd.read_msgpack(b"\xda\x00\x03abc") == "abc"


def test_toolchain_names_llvmlite_and_lld():
    tools = compiler.toolchain("amd")
    assert tools["llvmlite"] != "none" and tools["lld"].startswith(("LLD", "AMD"))
    assert "ptxas" not in tools


@pytest.mark.parametrize(
    "name, arch",
    [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx950", "gfx950"), ("gfx90a:xnack+", "gfx90a")],
)
def test_arch_of_gcn_arch_name(name, arch):
    assert hip.arch_of(name) == arch


def test_arch_of_refuses_other_names():
    with pytest.raises(ValueError, match="not an AMD GPU architecture name"):
        hip.arch_of("sm_90")


# --- the HIP runtime against a fake libamdhip64 ---------------------------------------------


class FakeHip:
    """libamdhip64's module API, recording calls; a launch rebuilds the kernarg segment the
    way HIP does from `void** kernelParams`: each explicit argument's bytes at its metadata
    offset."""

    def __init__(self, kernargs):
        self.calls, self.kernargs, self.segments = [], kernargs, []

    def hipSetDevice(self, device):
        self.calls.append(("hipSetDevice", device))
        return 0

    def hipModuleLoadData(self, module_ref, image):
        self.calls.append(("hipModuleLoadData", bytes(image)[:4]))
        module_ref._obj.value = 0x1000
        return 0

    def hipModuleGetFunction(self, function_ref, module, name):
        self.calls.append(("hipModuleGetFunction", module.value, name))
        function_ref._obj.value = 0x2000
        return 0

    def hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(self, out, function, block, shared):
        self.calls.append(("occupancy", function.value, block, shared))
        out._obj.value = 3
        return 0

    def hipFuncSetAttribute(self, function, attr, value):
        self.calls.append(("hipFuncSetAttribute", attr, value))
        return 0

    def hipGetErrorName(self, err):
        return b"hipErrorFake"

    def hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        argv = ctypes.cast(params.value, ctypes.POINTER(ctypes.c_void_p))
        segment = bytearray(max(a["offset"] + a["size"] for a in self.kernargs))
        for k, arg in enumerate(self.kernargs):
            segment[arg["offset"] : arg["offset"] + arg["size"]] = ctypes.string_at(
                argv[k], arg["size"]
            )
        self.segments.append(bytes(segment))
        self.calls.append(
            ("launch", f.value, gx.value, gy.value, gz.value, bx.value, shared.value,
             stream.value, extra.value)
        )  # fmt: skip
        return 0


@pytest.mark.parametrize("name", SPECS)
def test_hip_launcher_packs_the_kernargs_the_metadata_gives(artifacts, name):
    art = artifacts["gfx942", name]
    explicit = [a for a in art.meta["kernargs"] if not a["kind"].startswith("hidden_")]
    fake = FakeHip(explicit)
    launcher = hip.Launcher(art, 1, compute_units=304, lib=fake)
    assert fake.calls[:4] == [
        ("hipSetDevice", 1),
        ("hipModuleLoadData", b"\x7fELF"),
        ("hipModuleGetFunction", 0x1000, art.entry.encode()),
        ("occupancy", 0x2000, art.meta["block"], 0),
    ]
    assert launcher.resident_blocks == 3 * 304 and launcher.cluster == 1
    assert launcher.function_handle == 0x2000
    kinds = [kind for _, kind in art.meta["signature"]]
    args = [
        0x7F0000001000 + 0x100 * k if kind == "ptr" else 12345 + k for k, kind in enumerate(kinds)
    ]
    launcher(17, 0xABC, *args)
    assert fake.calls[-1] == ("launch", 0x2000, 17, 1, 1, art.meta["block"], 0, 0xABC, None)
    assert fake.segments[-1] == b"".join(struct.pack("<Q", a) for a in args)
    launcher((17, 3), 0xABC, *args)  # a grid in x and y (kernels reading block_id("y"))
    assert fake.calls[-1][2:5] == (17, 3, 1)
    launcher(5, 0xABC, *args)  # and back to one dimension: y is 1 again
    assert fake.calls[-1][2:5] == (5, 1, 1)
    with pytest.raises(ValueError, match="grid must be a block count or up to three"):
        launcher((1, 2, 3, 4), 0xABC, *args)
    with pytest.raises(TypeError, match="kernel takes"):
        launcher(1, 0, *args[:-1])


def test_hip_launch_errors_name_the_kernel(artifacts):
    art = artifacts["gfx942", "rmsnorm_fwd"]
    fake = FakeHip([])
    fake.hipModuleLaunchKernel = lambda *a: 98
    launcher = hip.Launcher(art, 0, compute_units=1, lib=fake)
    nargs = len(art.meta["signature"])
    with pytest.raises(RuntimeError, match=f"launching {art.entry} failed: hipErrorFake"):
        launcher(1, 0, *([0] * nargs))


def test_hip_launcher_refuses_cubins():
    art = Artifact(binary=b"x", format="cubin", entry="k", meta={"block": 32, "signature": []})
    with pytest.raises(ValueError, match="loads HSACO code objects, not cubin"):
        hip.Launcher(art, 0, compute_units=1, lib=FakeHip([]))


# --- every manifest kernel ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
def test_every_manifest_kernel_builds_for_amd(tmp_path, arch):
    """Every kernel of the tests and bench manifests compiles to a checked code object for
    `arch` (compile_kernel checks each against its signature); the bench set uses no scratch.
    The register and LDS figures are in each entry's metadata (and in warmup's lines)."""
    specs = list(dict.fromkeys([*manifest("tests"), *manifest("bench")]))
    results = cli.warmup(specs, arch, str(tmp_path), jobs=2)
    assert len(results) == len(specs)
    cache = DiskCache(tmp_path, read_only=True)
    from kbuild.cache import entry_key

    target = target_for_arch(arch)
    bench = set(manifest("bench"))
    for spec in specs:
        artifact = cache.get(entry_key(spec, target), None)
        assert artifact is not None and artifact.format == "hsaco", spec.short()
        if spec in bench:
            assert artifact.meta["scratch_bytes"] == 0, (spec.short(), artifact.meta["vgprs"])


# --- choosing the AMD path under a ROCm torch ----------------------------------------------


class _Props:
    gcnArchName = "gfx942:sramecc+:xnack-"
    multi_processor_count = 304


@pytest.mark.not_interpreted
def test_rocm_torch_gets_the_amd_target_and_the_hip_launcher(monkeypatch):
    import torch

    from kbuild import jit

    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props())
    assert jit.device_target(0) == target_for_arch("gfx942")
    made = []
    monkeypatch.setattr(hip, "Launcher", lambda art, dev, units: made.append((dev, units)))
    jit._load(Artifact(binary=b"", format="hsaco", entry="k", meta={}), 3)
    assert made == [(3, 304)]


def test_rocm_torch_declines_the_cuda_hot_path(monkeypatch):
    import torch

    from kbuild import native

    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(native, "_LOADED", [])  # as in a process that has not loaded it
    monkeypatch.setattr(native, "_HOOKS", [])  # (this one's operators left as they are)
    with pytest.warns(RuntimeWarning, match="CUDA-only so far"):
        assert native.load(force=True) is None
