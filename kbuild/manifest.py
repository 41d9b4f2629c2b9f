"""Named kernel lists: what `kbuild warmup` compiles and what the GPU tests and benchmarks use.

One source of truth: the GPU tests and bench/ draw their shapes from the constants below, and
warmup compiles exactly the specs the ops layer will ask for with those shapes, so a cache
warmed here on a CPU machine serves the GPU run with `KBUILD_OFFLINE=1`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .spec import KernelSpec

DTYPES = ("f32", "f16", "bf16")
TEST_N = (1, 7, 127, 768, 1000, 4096, 5120, 8192, 12288, 65536)
TEST_M = (0, 1, 3, 4096)
TEST_EPS = (1e-6, 1e-2)
BENCH_N = (1024, 2048, 4096, 8192, 16384, 65536)
BENCH_ELEMENTS = 64 * 2**20  # M * N for every bandwidth benchmark shape
BENCH_DTYPE = "bf16"
TINY_SHAPE = (4, 4096)  # host-overhead benchmark
STANDARD_N = (1024, 4096, 8192)


def weight_dtypes(dtype: str) -> tuple[str | None, ...]:
    """Weights the tests cover for inputs of `dtype`: same dtype, fp32, none."""
    return (dtype, "f32", None) if dtype != "f32" else ("f32", None)


def _rmsnorm_tests() -> Iterator[KernelSpec]:
    from .ops.rmsnorm import rmsnorm_fwd_spec

    for N in TEST_N:
        for dtype in DTYPES:
            for w in weight_dtypes(dtype):
                for store_rstd in (False, True):
                    yield rmsnorm_fwd_spec(N, dtype, w, store_rstd, 1e-6)
    yield rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-2)
    yield rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6, is_aligned=False)


def _rmsnorm_bench() -> Iterator[KernelSpec]:
    from .ops.rmsnorm import rmsnorm_fwd_spec

    for N in BENCH_N:
        yield rmsnorm_fwd_spec(N, BENCH_DTYPE, BENCH_DTYPE, False, 1e-6)
    yield rmsnorm_fwd_spec(TINY_SHAPE[1], BENCH_DTYPE, BENCH_DTYPE, False, 1e-6)


def _standard() -> Iterator[KernelSpec]:
    from .ops.rmsnorm import rmsnorm_fwd_spec

    for N in STANDARD_N:
        yield rmsnorm_fwd_spec(N, "bf16", "bf16", False, 1e-6)
        yield rmsnorm_fwd_spec(N, "bf16", "bf16", True, 1e-6)


MANIFESTS: dict[str, Callable[[], Iterator[KernelSpec]]] = {
    "standard": _standard,
    "tests": _rmsnorm_tests,
    "bench": _rmsnorm_bench,
}


def manifest(name: str) -> list[KernelSpec]:
    """The specs of a named manifest, without duplicates, in a stable order."""
    if name not in MANIFESTS:
        raise ValueError(f"manifest must be one of {', '.join(MANIFESTS)}; got {name!r}")
    return list(dict.fromkeys(MANIFESTS[name]()))
