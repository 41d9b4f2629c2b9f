"""A row softmax written as a user writes one, outside kbuild: two kernels declared with
`kbuild.kernel` and built with `kbuild.dsl`, and the op that runs them (`kbuild.Op`: a torch
custom op, its backward and autograd, from one description).

    python examples/custom_softmax.py   # compiles for sm_90 and gfx942 (where MLIR is), then
                                        # checks values and gradients on the GPU or the CPU

The builders import the DSL inside: it needs MLIR, which a machine running from a warmed
cache (KBUILD_OFFLINE=1) does not have, and this module must import there too.
"""

from __future__ import annotations

import torch

import kbuild
from kbuild import Arg, Launch, Like, Op, Out, Param, Rows
from kbuild.plan.rows import row_kernel

# vectorize: 16-byte accesses (the op passes True where its tensors start 16-byte aligned);
# rows of any width take them, a row that is not a whole number of vectors is peeled.
ROW = (Param("N", "int"), Param("dtype", "dtype"), Param("vectorize", "bool", True))


@kbuild.kernel("user_softmax_fwd", params=ROW, args=(Arg("x"), Arg("y"), Arg("M", "i64")),
               tunable=True)  # fmt: skip
def build_softmax_fwd(N: int, dtype: str, target, vectorize: bool = True, **overrides):
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along rows of N; reads x once (twice for
    rows too long for registers), writes y. One reduction: each thread's (max, sum of exp(x -
    max)) over its own columns, merged over the row as an online softmax (softmax_pair)."""
    from kbuild.dsl import (
        NEG_INF,
        RowTile,
        const,
        eq,
        exp,
        maximum,
        select,
        softmax_pair,
        thread_max,
        thread_sum,
    )

    # one row group per block (or cluster), planned for a row held in registers through an
    # online reduction and a second pass (online: plan_rows' online_budget)
    k, row = row_kernel("user_softmax_fwd", N, dtype, target, vectorize=vectorize, online=True,
                        **overrides)  # fmt: skip
    with k:
        x, y, M = k.ptr("x"), k.ptr("y"), k.i64("M")
        t = RowTile(k, row, M)
        v = t.values(x, dtype, pad=NEG_INF)  # its f32 values; past N: -inf, which exp makes 0

        if row.chunked:  # each chunk read twice: its exp(x - m) is taken again to write y

            def own(c, state):  # this thread's (max, sum) with a chunk's columns added
                m = maximum(state[0], thread_max(v(c)))
                safe = select(eq(m, NEG_INF), 0.0, m)  # a thread that holds only padding
                e = thread_sum([exp(a - safe) for a in v(c)])
                return [m, state[1] * exp(state[0] - safe) + e]

            m, s = t.reduce(t.over_chunks(own, [const(NEG_INF), const(0.0)]), softmax_pair)
            write = lambda c: [exp(a - m) * (1.0 / s) for a in v(c)]  # noqa: E731
        else:  # exp(x - own max) held, rescaled once to the row's max
            m_own = thread_max(v(0))
            safe = select(eq(m_own, NEG_INF), 0.0, m_own)  # a thread that holds only padding
            e = [exp(a - safe) for a in v(0)]
            m, s = t.reduce([m_own, thread_sum(e)], softmax_pair)
            # exp(m_own - m) <= 1; not exp(safe - m), which overflows for a thread of -inf
            # (masked) values in a row whose maximum is below -88, making 0 * inf = NaN
            scale = exp(m_own - m) * (1.0 / s)
            write = lambda c: [a * scale for a in e]  # noqa: E731
        t.over_chunks(lambda c, _: t.store(y, write(c), dtype, c) or [])
    return k


@kbuild.kernel(
    "user_softmax_bwd",
    params=ROW,
    args=(Arg("y"), Arg("dy"), Arg("dx"), Arg("M", "i64")),
    tunable=True,
)
def build_softmax_bwd(N: int, dtype: str, target, vectorize: bool = True, **overrides):
    """dx = y * (dy - sum(y * dy)) along rows; reads y and dy once (twice for rows too long
    for registers), writes dx."""
    from kbuild.dsl import RowTile, const, thread_sum

    k, row = row_kernel("user_softmax_bwd", N, dtype, target, vectorize=vectorize, rows_held=2,
                        **overrides)  # fmt: skip
    with k:
        yp, dyp, dxp, M = k.ptr("y"), k.ptr("dy"), k.ptr("dx"), k.i64("M")
        t = RowTile(k, row, M)
        y, dy = t.values(yp, dtype), t.values(dyp, dtype)
        pairs = lambda c: zip(y(c), dy(c), strict=True)  # noqa: E731
        dot = t.over_chunks(lambda c, d: [d[0] + thread_sum([a * b for a, b in pairs(c)])],
                            [const(-0.0)])  # fmt: skip
        (d,) = t.sum(*dot)
        t.over_chunks(lambda c, _: t.store(dxp, [a * (b - d) for a, b in pairs(c)], dtype, c) or [])
    return k


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """fp32 math, one rounding to x's dtype: what CPU tensors run."""
    return torch.softmax(x.float(), -1).to(x.dtype)


def softmax_backward_reference(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    y32, dy32 = y.float(), dy.float()
    return (y32 * (dy32 - (y32 * dy32).sum(-1, keepdim=True))).to(y.dtype)


# The two ops, one description each: schema, checks, fake, CPU (the reference), CUDA (the
# kernel, its N, dtype, vectorize and arguments bound by name) and, through the backward
# op's names (y saved, dy the gradient of y, dx that of x), the autograd formula.
softmax = Op(
    "user_softmax::softmax",
    args=(Rows("x"),),
    outputs=(Out("y", like="x"),),
    launch=Launch(build_softmax_fwd),
    reference=softmax_reference,
    backward=Op(
        "user_softmax::softmax_backward",
        args=(Rows("y"), Like("dy", "y")),
        outputs=(Out("dx", like="y"),),
        launch=Launch(build_softmax_bwd),
        reference=softmax_backward_reference,
    ),
)


def warmup_specs():
    """What `kbuild warmup --module examples/custom_softmax.py` compiles (one width:
    `--ops user_softmax::softmax --hidden N`)."""
    shapes = [(4096, "bf16"), (4097, "bf16"), (32768, "bf16"), (50257, "bf16"),
              (151936, "bf16"), (1000, "f32"), (3001, "f32"), (4096, "f32"), (4097, "f32"),
              (151936, "f32")]  # fmt: skip
    return [spec for N, dtype in shapes for spec in softmax.warm_specs(N, dtype, misaligned=False)]


def main() -> None:
    import importlib.util

    from kbuild.compiler import compile_kernel
    from kbuild.targets import target_for_arch

    arches = [a for a, need in (("sm_90", "mlir"), ("gfx942", "llvmlite"))
              if importlib.util.find_spec(need) and importlib.util.find_spec("mlir")]  # fmt: skip
    for arch in arches:  # compiled here, GPU or not
        for spec in warmup_specs():
            art = compile_kernel(spec, target_for_arch(arch))
            print(f"{arch:6} {spec.short()}: {art.format}, {len(art.binary)} bytes")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape, dtype in (((64, 1000), torch.float32), ((8, 3, 4096), torch.bfloat16)):
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        (dx,) = torch.autograd.grad(softmax(x), x, dy)
        ref = torch.softmax(x.double(), -1)
        (dref,) = torch.autograd.grad(ref, x, dy.double())
        err = (softmax(x).double() - ref).abs().max().item()
        derr = (dx.double() - dref).abs().max().item()
        print(f"{device} {tuple(shape)} {dtype}: y error {err:.2e}, dx error {derr:.2e}")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert err < tol and derr < tol * 10, (err, derr)


if __name__ == "__main__":
    main()
