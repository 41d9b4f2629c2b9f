"""GPU targets: what a kernel is compiled for. Pure data here; lowering lives in nvidia.py/amd.py.

A Target is everything that changes code generation besides the kernel's own parameters:
vendor, architecture, feature string, warp size and the pass pipeline. Kernels read the warp
size from it and never branch on the vendor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Each NVIDIA arch with the lowest PTX ISA that supports it. LLVM aborts the whole process
# (not a Python exception) when asked for an arch its default PTX version rejects, so arches
# are validated against this table before any lowering starts.
_NVIDIA_PTX = {
    "sm_80": "+ptx70",
    "sm_86": "+ptx71",
    "sm_89": "+ptx78",
    "sm_90": "+ptx81",  # 8.1: st.async (dsl/mbarrier.py)
    "sm_90a": "+ptx81",
    "sm_100": "+ptx86",
    "sm_100a": "+ptx86",
    "sm_120": "+ptx87",
}
_AMD_WAVE = {"gfx90a": 64, "gfx942": 64, "gfx950": 64, "gfx1100": 32, "gfx1201": 32}
# Shared memory (LDS) one block may use, in KB: the opt-in maximum per block on NVIDIA (CUDA
# programming guide, compute capabilities table), the LDS per workgroup on AMD.
_SHARED_KB = {
    "sm_80": 163,
    "sm_86": 99,
    "sm_89": 99,
    "sm_90": 227,
    "sm_90a": 227,
    "sm_100": 227,
    "sm_100a": 227,
    "sm_120": 99,
    "gfx90a": 64,
    "gfx942": 64,
    "gfx950": 160,
    "gfx1100": 64,
    "gfx1201": 64,
}

NVIDIA_PIPELINE = (
    "builtin.module(gpu.module(convert-scf-to-cf, convert-gpu-to-nvvm{index-bitwidth=64}, "
    "canonicalize, cse), reconcile-unrealized-casts, gpu-module-to-binary{format=isa})"
)
AMD_PIPELINE = (
    "builtin.module(gpu.module(convert-scf-to-cf, convert-gpu-to-rocdl{{chipset={arch} "
    "index-bitwidth=64}}, canonicalize, cse), reconcile-unrealized-casts)"
)


class ToolchainError(RuntimeError):
    """A compiler tool kbuild needs is missing or cannot run; the message names it and the fix."""


def tool_from_env(variable: str) -> str | None:
    """The executable `$variable` names, None where the variable is unset or empty; a path
    that is not an executable file raises ToolchainError naming the variable (rather than a
    subprocess traceback at the first compile)."""
    path = os.environ.get(variable)
    if not path:
        return None
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ToolchainError(f"{variable}={path} is not an executable file")
    return path


@dataclass(frozen=True)
class Target:
    vendor: str  # "nvidia" | "amd"
    arch: str  # "sm_90", "gfx942", ...
    features: str  # "+ptx80" for NVIDIA; "" for AMD
    warp_size: int

    @property
    def pipeline(self) -> str:
        if self.vendor == "nvidia":
            return NVIDIA_PIPELINE
        return AMD_PIPELINE.format(arch=self.arch)

    @property
    def binary_format(self) -> str:
        return "cubin" if self.vendor == "nvidia" else "hsaco"

    @property
    def mlir_attr(self) -> str:
        """The target attribute placed on a kernel's gpu.module."""
        if self.vendor == "nvidia":
            return f'#nvvm.target<chip = "{self.arch}", features = "{self.features}", O = 3>'
        return f'#rocdl.target<chip = "{self.arch}", O = 3>'

    def occupancy_attribute(self, min_blocks_per_sm: int | None) -> tuple[str, str] | None:
        """The kernel attribute asking for `min_blocks_per_sm` resident blocks, if any."""
        if min_blocks_per_sm is None or self.vendor != "nvidia":
            return None  # AMD: the compiler's own occupancy heuristics
        return "nvvm.minctasm", f"{int(min_blocks_per_sm)} : i32"

    @property
    def forward_register_scale(self) -> float:
        """How much of the chooser's per-thread budget for a forward kernel's row (measured
        on NVIDIA) this target's code generation holds in registers. AMD: half. At the full
        budget the RMSNorm forward of a 65536 bf16 row (1024 threads, 64 elements each)
        took 128 VGPRs, 64 AGPRs and 124 bytes of scratch on gfx942 (52 on gfx950): the
        AMDGPU backend keeps widened fp32 copies of the packed bf16 row live. At half that
        row is walked in chunks and no bench kernel spills (bench/results/
        amd_resources.json); the backward kernels' budgets did not spill and stay whole."""
        return 0.5 if self.vendor == "amd" else 1.0

    @property
    def shared_bytes_per_block(self) -> int:
        """The most shared memory (static + dynamic) one block may use on this target."""
        return _SHARED_KB[self.arch] * 1024

    @property
    def _sm(self) -> int:
        return int(self.arch[3:].rstrip("a")) if self.vendor == "nvidia" else 0

    @property
    def l2_prefetch(self) -> bool:
        """Whether one thread can ask for a whole span of global memory to be brought into L2
        ahead of its loads (`cp.async.bulk.prefetch.L2`, Hopper and later)."""
        return self._sm >= 90

    @property
    def async_copy(self) -> bool:
        """Whether global memory can be copied into shared memory without passing through
        registers (`cp.async`, Ampere and later)."""
        return self._sm >= 80

    @property
    def max_cluster(self) -> int:
        """Most blocks a kernel may group into one cluster sharing shared memory (thread
        block clusters, Hopper and later); 1 where there are none."""
        if self._sm >= 90:
            return 8  # the portable cluster size limit
        return 1

    @property
    def max_cluster_nonportable(self) -> int:
        """Most blocks per cluster the hardware allows when a kernel opts in (the runtime sets
        CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED for clusters past `max_cluster`):
        16 on Hopper and Blackwell."""
        return 16 if self._sm >= 90 else 1

    def cluster_attribute(self, cluster: int) -> tuple[str, str] | None:
        """The kernel attribute fixing its cluster shape (`.reqnctapercluster`), if any."""
        if cluster == 1:
            return None
        if cluster > self.max_cluster_nonportable:
            raise ValueError(
                f"{self.arch} allows clusters of at most {self.max_cluster_nonportable}"
            )
        return "nvvm.cluster_dim", f"array<i32: {cluster}, 1, 1>"

    def key_fields(self) -> dict[str, str | int]:
        return {
            "vendor": self.vendor,
            "arch": self.arch,
            "features": self.features,
            "warp_size": self.warp_size,
            "pipeline": self.pipeline,
        }

    def __str__(self) -> str:
        return self.arch


def target_for_arch(arch: str) -> Target:
    """`sm_90` / `sm_80` / `gfx942` ... -> Target; unknown arches raise ValueError."""
    if arch in _NVIDIA_PTX:
        return Target("nvidia", arch, _NVIDIA_PTX[arch], 32)
    if arch in _AMD_WAVE:
        return Target("amd", arch, "", _AMD_WAVE[arch])
    known = ", ".join(sorted(_NVIDIA_PTX) + sorted(_AMD_WAVE))
    raise ValueError(f"arch must be one of {known}; got {arch!r}")


def target_for_capability(major: int, minor: int) -> Target:
    """The Target for a CUDA device of compute capability (major, minor)."""
    arch = f"sm_{major}{minor}"
    if arch not in _NVIDIA_PTX:
        # Binary-compatible fallback within a major version (sm_87 runs sm_80 code).
        candidates = [a for a in _NVIDIA_PTX if a.startswith(f"sm_{major}") and not a.endswith("a")]
        if not candidates:
            raise ValueError(f"no kbuild target for compute capability {major}.{minor}")
        arch = min(candidates)
    return target_for_arch(arch)
