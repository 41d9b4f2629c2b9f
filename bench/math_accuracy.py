"""Accuracy of kbuild.dsl's f32 math on the GPU: every one of the 2^32 f32 inputs through each
function, against torch's fp64, in ulps of the f32 result; and whether a function's vector
form gives the scalar form's bits. The CPU tests (tests/test_dsl_math_prims_cpu.py) measure
the same formulas with the host's 2^x; this is the hardware's (`ex2.approx.f32` on NVIDIA).

    kbuild warmup --arch sm_90 --module bench/math_accuracy.py --cache-dir .kbuild-aot
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/math_accuracy.py [out.json]

The probe is a kernel of kbuild's own kind written as a user writes one (kbuild.kernel, the
DSL's grid-stride walk, kbuild.launch).
"""

from __future__ import annotations

import json
import sys

from kbuild import Arg, Param, kernel

FUNCTIONS = ("exp2", "exp", "log", "log2", "tanh", "sigmoid", "erf", "sin", "cos", "absolute")
BLOCK = 256


@kernel(
    "math_probe",
    params=(Param("function", "int"), Param("width", "int")),
    args=(Arg("x"), Arg("y"), Arg("n", "i64")),
)
def build_math_probe(function: int, width: int, target):
    """y[i] = FUNCTIONS[function](x[i]) over n f32 values, `width` lanes a thread per step."""
    from kbuild import dsl

    f = getattr(dsl, FUNCTIONS[function])
    with dsl.Kernel("math_probe", target, BLOCK) as k:
        x, y, n = k.ptr("x"), k.ptr("y"), k.i64("n")

        def step(i, carried):
            value = dsl.load(dsl.get_llvm_ptr(x, i * width, "f32"), "f32", width)
            dsl.store(f(value), dsl.get_llvm_ptr(y, i * width, "f32"))
            return []

        k.grid_stride(n / width, step)
    return k


def warmup_specs():
    return [build_math_probe.spec(f, w) for f in range(len(FUNCTIONS)) for w in (1, 4)]


def ulps(got, want):
    """|got - want| in ulps of the f32 nearest `want` (fp64); equal specials count 0, a NaN on
    one side only counts inf."""
    import torch

    want32 = want.float()
    magnitude = want32.abs().double().clamp(min=2.0**-126, max=3.4028234663852886e38)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - 23)
    error = (got.double() - want).abs() / ulp
    same = (got.double() == want) | (torch.isinf(want32) & (got == want32))
    same |= torch.isnan(got) & torch.isnan(want)
    error = torch.where(same, torch.zeros_like(error), error)
    return torch.where(torch.isnan(got) != torch.isnan(want), torch.inf, error)


def measure(chunk: int = 1 << 28) -> dict:
    import torch

    import kbuild

    results = {}
    for index, name in enumerate(FUNCTIONS):
        reference = getattr(
            torch.special if name == "erf" else torch, name.replace("absolute", "abs")
        )
        worst, where, over = 0.0, None, [0, 0]
        vector_is_scalar = True
        for start in range(0, 1 << 32, chunk):
            bits = torch.arange(start, start + chunk, dtype=torch.int64, device="cuda")
            x = (
                torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
                .to(torch.int32)
                .view(torch.float32)
            )
            ys = []
            for width in (4, 1):
                y = torch.empty_like(x)
                grid = 132 * 8  # a few waves; the walk covers the rest
                kbuild.launch(build_math_probe, grid, x, y, chunk, function=index, width=width)
                ys.append(y)
            vector_is_scalar &= torch.equal(ys[0].view(torch.int32), ys[1].view(torch.int32))
            error = ulps(ys[0], reference(x.double()))
            k = int(error.argmax())
            if float(error[k]) > worst:
                worst, where = float(error[k]), (float(x[k]), float(ys[0][k]))
            over[0] += int((error > 1).sum())
            over[1] += int((error > 2).sum())
        results[name] = {
            "max_ulp": worst, "at_x_got": where, "over_1_ulp": over[0], "over_2_ulp": over[1],
            "vector_equals_scalar": vector_is_scalar,
        }  # fmt: skip
        print(name, results[name], flush=True)
    return results


if __name__ == "__main__":
    import torch

    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "math": measure()}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1)
