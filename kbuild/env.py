"""Every environment variable kbuild reads, in one place.

KBUILD_CACHE_DIR           disk cache root (default $XDG_CACHE_HOME/kbuild or ~/.cache/kbuild)
KBUILD_OFFLINE=1           never compile: load kernels from the disk cache only; a miss raises
                           KernelNotCached naming the kernel and the warmup command. Implied
                           when the MLIR bindings are not installed.
KBUILD_PTXAS               path of the ptxas to assemble cubins with (default: PATH, CUDA_HOME)
KBUILD_MEMORY_CACHE_SIZE   loaded kernels kept per process (default 4096)
KBUILD_DUMP_DIR=DIR        write every stage of each compile (kernel.mlir, kernel.ptx or
                           kernel.ll, the binary, meta.json) to DIR/<kernel>-<arch>-<hash>/;
                           `kbuild show SPEC --mlir --llvm --ptx --asm --sass` prints them
KBUILD_RECORD=FILE         append every kernel spec this process asks for to FILE (JSON lines,
                           deduplicated across processes; offline misses too, before they
                           raise); `kbuild warmup --from FILE --arch ...` compiles them
KBUILD_NATIVE=0            do not build or load the C++ hot path (kbuild/native): the Python
                           launch path runs (same kernels, more host time per call)
KBUILD_NATIVE=1            build and load it at import, CUDA or not (unset: at the first CUDA
                           call, never in a CPU-only process; `kbuild.native.load(force=True)`
                           does the same from code: CPU tests of its kernels)
KBUILD_NATIVE_DIR          where the C++ extension is built and kept (default
                           $XDG_CACHE_HOME/kbuild/native, else ~/.cache/kbuild/native)
CXX                        the C++ compiler that builds it (default g++)
KBUILD_LLD                 the ld.lld that links AMD code objects (default: ROCm's, then the
                           ziglang wheel's, then PATH); its version is in the cache key
KBUILD_LIBAMDHIP           the HIP runtime library to load on ROCm (default libamdhip64.so)
KBUILD_INTERPRET=1         (set before import) CPU tensors take the CUDA path: the ops' launch
                           code, plans and autograd, with kernels run by kbuild.interpret on
                           the CPU (`1` or an NVIDIA arch: built for sm_90 or that arch;
                           `gfx942` / `gfx950`: the AMD kernels, wave64). No C++ hot path.
KBUILD_INTERPRET_RACES=0   the interpreter's shared-memory race check off (on by default)
KBUILD_INTERPRET_LOWERED=1 the interpreter runs the lowered module (NVVM / ROCDL, the LLVM
                           dialect, unstructured control flow) instead of the builder's

Only KBUILD_PTXAS changes generated code, and the ptxas version is part of every cache key.
"""

from __future__ import annotations

import functools
import importlib.util
import os


def interpret() -> bool:
    """KBUILD_INTERPRET set: CPU tensors take the GPU path through the interpreter."""
    return os.environ.get("KBUILD_INTERPRET", "") not in ("", "0")


def offline() -> bool:
    return os.environ.get("KBUILD_OFFLINE", "") not in ("", "0") or not compiler_available()


@functools.cache
def compiler_available() -> bool:
    """True where the MLIR bindings are installed (checked without importing them)."""
    return importlib.util.find_spec("mlir") is not None
