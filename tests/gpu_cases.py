"""The case lists the GPU tests iterate, kept in one place so that tests/test_launch_keys_cpu.py
drives the same matrix on CPU (with a fake launcher) and checks that every kernel it asks for
is in manifest("tests"). The GPU machine runs offline from a cache warmed from that manifest:
a case added here without its kernels in kbuild/cli/manifest.py fails on CPU, not only on the GPU.
"""

from __future__ import annotations

from kbuild.cases import TEST_M
from kbuild.cli.widths import affine_dtypes, residual_dtypes, weight_dtypes

RSTD_N = (7, 4096, 65536)  # test_rmsnorm_gpu.test_rstd_matches
LARGE_MEAN_N = (768, 4096, 65536)  # test_layernorm_gpu.test_large_mean_keeps_fp32_accuracy
DETERMINISTIC_N = (1000, 4096, 4097, 16384, 65536)  # the bitwise dw (and db) tests of the norms


def rmsnorm_cases(dtype: str) -> list[tuple[int, str | None]]:
    """(M, weight dtype) of the RMSNorm forward and backward tests at one N and x dtype."""
    return [(M, w) for M in TEST_M for w in weight_dtypes(dtype)]


def fused_cases(dtype: str) -> list[tuple[int, str, str, bool]]:
    """(M, weight dtype, residual_out dtype, with dresidual_out) of test_fused_add_rmsnorm."""
    return [
        (M, w, residual, with_dres)
        for M in TEST_M
        for w in (dtype, "f32")
        for residual in residual_dtypes(dtype)
        for with_dres in (False, True)
    ]


def layernorm_cases(dtype: str) -> list[tuple[int, str | None, str | None]]:
    """(M, weight dtype, bias dtype) of test_layernorm_forward_backward."""
    return [(M, w, b) for M in TEST_M for w, b in affine_dtypes(dtype)]
