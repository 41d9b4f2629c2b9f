"""The C++ generic kernel of ops declared with kbuild.Op (kbuild/native/generic.h), checked on
CPU against the Python launch path (`Op._launch_cuda`): for the same call both must ask for
the same kernels (specs), with the same grids and the same arguments (each pointer named by
the tensor it belongs to), allocate the same outputs, and resolve each kernel once.

The C++ kernel runs on CPU tensors through the extension's `run_generic` with the launch
hook set (it records launches instead of calling the driver); both paths load kernels through
a fake `launcher_for`. Catches: a value the C++ key drops or reads from the wrong argument (a
stale kernel: eps, a dtype, the alignment bit), an argument slot pointing at the wrong tensor,
a wrong grid, an output of the wrong shape or dtype or one not left empty, a key resolved on
every call, a Python-computed binding sent to C++ (which cannot compute it).
"""

from __future__ import annotations

import pytest
import torch

from kbuild import native
from kbuild.op import binding as op_launch
from kbuild.op import opdef
from kbuild.op.opdef import Feature, Ids, Launch, Op, Out, Rows, Scalar, eps
from kbuild.op.tensors import DTYPE_NAMES
from kbuild.registry import Arg, KernelDef, Param

from .examples import import_example

NATIVE = native.load(force=True)  # on a CPU too: its kernels run through the launch hook
# not_interpreted: KBUILD_INTERPRET turns the extension off (the Python launch path runs)
pytestmark = [
    pytest.mark.skipif(NATIVE is None, reason="the C++ extension is unavailable"),
    pytest.mark.not_interpreted,
]

# A row kernel with what the norms' have: an optional weight and its dtype, a stored
# statistic, a float, a dtype parameter, the alignment bit and a default left alone.
NORMISH = KernelDef(
    "generic_test_norm",
    "tests.nowhere:build",  # never compiled here
    (
        Param("N", "int"),
        Param("dtype", "dtype"),
        Param("weight_dtype", "dtype?"),
        Param("store_stats", "bool"),
        Param("eps", "float"),
        Param("out_dtype", "dtype"),
        Param("vectorize", "bool", True, vectors_of=("dtype",)),
        Param("unroll", "int", 2),
    ),
    (
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("y"),
        Arg("stats", when="store_stats"),
        Arg("M", "i64"),
    ),
)


def _declare() -> Op:
    name = "kbuild_generic_test::norm"
    if name in opdef.DEFINED:
        return opdef.DEFINED[name]
    return Op(
        name,
        args=(
            Rows("x"),
            Feature("weight"),
            Scalar("out_dtype", "dtype"),
            eps(1e-6),
            Scalar("store_stats", "bool", False),
        ),
        outputs=(
            Out("y", like="x", dtype="out_dtype"),
            Out("stats", rows="x", when="store_stats"),
            Out("dw", like="weight", when="weight"),  # not the kernel's: a sum over rows
        ),
        launch=Launch(NORMISH),
        reference=lambda x, weight, out_dtype, eps, store_stats: (
            x.to(out_dtype),
            x.float().mean(-1),
            None if weight is None else x.float().sum(0).to(weight.dtype),
        ),
    )


NORM = _declare()


class FakeLauncher:
    """What both paths read of a loaded kernel; calling it records a Python-path launch."""

    def __init__(self, log, spec, names, persistent):
        self.log, self.spec, self.names = log, spec, names
        self.function_handle, self.block, self.dynamic_shared = 0, 128, 0
        self.cluster, self.rows_per_block, self.resident_clusters = 2, 3, 4
        self.meta = {"grid": "persistent"} if persistent else {}

    def __call__(self, grid, stream, *args):
        self.log.append(("py", self.spec.short(), grid, list(args)))


@pytest.fixture
def paths(monkeypatch):
    """Both paths behind one fake tier; yields (log, resolved kernels, persistent switch)."""
    log, resolved, persistent = [], [], {"on": False}

    def launcher_for(kernel, device, values):
        spec = kernel.spec(*values)
        resolved.append(spec.short())
        return FakeLauncher(log, spec, kernel.arg_names(spec), persistent["on"])

    monkeypatch.setattr(op_launch, "launcher_for", launcher_for)
    monkeypatch.setattr(op_launch, "stream_of", lambda device: 0)
    monkeypatch.setattr(opdef, "device_guard", lambda t: torch.no_grad())
    NATIVE.clear_records()
    NATIVE.set_launch_hook(lambda name, grid, args: log.append(("cpp", name, grid, list(args))))
    yield log, resolved, persistent
    NATIVE.set_launch_hook(None)
    NATIVE.clear_records()


def _named(launches, tensors):
    """Launches with pointers named by the tensor they are the address of ("copy" for one
    made inside the call; ints as they are)."""
    names = {
        t.data_ptr(): name
        for name, t in tensors.items()
        if isinstance(t, torch.Tensor) and t.numel()
    }

    def name(a):  # an address no tensor given has: a copy the call made (M is small)
        return names.get(a, "copy" if a > 1 << 32 else a)

    return [(spec, grid, [name(a) for a in args]) for _, spec, grid, args in launches]


def _both(op, args, log):
    """(C++ launches, Python launches, C++ outputs, Python outputs) for one call."""
    cpp_out = NATIVE.run_generic(op.name, list(args))
    cpp, log[:] = list(log), []
    py_out = op._launch_cuda(*args)
    py_out = (py_out,) if isinstance(py_out, torch.Tensor) else py_out
    py, log[:] = list(log), []
    inputs = dict(zip(op.arg_names, args, strict=True))
    outputs = [o.name for o in op.outputs]
    cpp_named = _named(cpp, {**inputs, **dict(zip(outputs, cpp_out, strict=True))})
    py_named = _named(py, {**inputs, **dict(zip(outputs, py_out, strict=True))})
    return cpp_named, py_named, cpp_out, py_out


def _aligned(shape, dtype):
    return torch.randn(shape).to(dtype)


def _misaligned(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


CASES = [
    # (M, N, x dtype, weight dtype or None, store_stats, eps, out dtype, x maker)
    (5, 64, torch.bfloat16, torch.bfloat16, True, 1e-6, torch.bfloat16, _aligned),
    (5, 64, torch.bfloat16, torch.float32, False, 1e-5, torch.float32, _aligned),
    (7, 24, torch.float16, None, True, 0.0, torch.float16, _aligned),
    (7, 24, torch.float32, None, False, 1e-2, torch.bfloat16, _misaligned),
    (3, 8, torch.bfloat16, torch.bfloat16, True, 1e-6, torch.bfloat16, _misaligned),
]


@pytest.mark.parametrize("persistent", [False, True], ids=["rows", "persistent"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}-{c[4]}")
def test_same_launches_and_outputs_as_the_python_path(paths, case, persistent):
    log, _, switch = paths
    switch["on"] = persistent
    M, N, dtype, wdtype, store, eps_, out_dtype, make = case
    x = make((M, N), dtype)
    w = None if wdtype is None else torch.randn(N).to(wdtype)
    args = (x, w, out_dtype, eps_, store)
    cpp, py, cpp_out, py_out = _both(NORM, args, log)
    assert cpp == py and len(cpp) == 1
    spec, grid, named = cpp[0]
    groups = -(-M // 3)
    assert grid == (min(groups, 4) if persistent else groups) * 2
    assert named == ["x", *(["weight"] if w is not None else []), "y",
                     *(["stats"] if store else []), M]  # fmt: skip
    assert f"eps={eps_!r}" in spec or (eps_ == 0.0 and "eps=0.0" in spec)
    for a, b in zip(cpp_out, py_out, strict=True):
        assert (a.shape, a.dtype, a.is_contiguous()) == (b.shape, b.dtype, b.is_contiguous())


@pytest.fixture
def deterministic():
    """torch.empty filled with NaN (deterministic mode): uninitialised outputs show."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def test_outputs_not_wanted_and_rows_without_elements(paths, deterministic):
    """No launch for M = 0 or N = 0; a statistic of rows with no elements is NaN, an
    unwanted one empty fp32 (the Python path's, the fake's), and with no rows an (N,) output
    (a parameter's gradient, a sum over no rows) is zeros, not uninitialised memory."""
    log, _, _ = paths
    for shape in ((0, 16), (4, 0)):
        x = torch.zeros(shape, dtype=torch.bfloat16)
        w = torch.ones(shape[1], dtype=torch.bfloat16)
        for store in (False, True):
            cpp, py, cpp_out, py_out = _both(NORM, (x, w, torch.bfloat16, 1e-6, store), log)
            assert cpp == py == []
            for a, b in zip(cpp_out, py_out, strict=True):
                assert (a.shape, a.dtype) == (b.shape, b.dtype)
                assert torch.equal(a.isnan(), b.isnan())
            if shape[0] == 0:
                assert torch.equal(cpp_out[2], torch.zeros(16, dtype=torch.bfloat16))
            if store and shape[1] == 0:
                assert cpp_out[1].shape == (4,) and cpp_out[1].isnan().all()
            if not store:
                assert cpp_out[1].shape == (0,) and cpp_out[1].dtype == torch.float32


def test_a_strided_input_is_read_as_a_dense_copy(paths):
    log, _, _ = paths
    x = torch.randn(16, 8).to(torch.bfloat16).t()  # (8, 16), not contiguous
    cpp, py, _, _ = _both(NORM, (x, None, torch.bfloat16, 1e-6, False), log)
    assert cpp == py
    assert cpp[0][2] == ["copy", "y", 8]  # a dense copy's address, not x's


def test_each_key_resolves_once_and_every_value_splits_it(paths):
    """A second call asks Python for nothing; each value the key holds (eps by its bits, a
    dtype, the weight's presence, the flag, the alignment bit) makes a kernel of its own."""
    log, resolved, _ = paths
    x = _aligned((4, 64), torch.bfloat16)
    w = torch.randn(64).to(torch.bfloat16)
    base = [x, w, torch.bfloat16, 1e-6, True]
    NATIVE.run_generic(NORM.name, base)
    NATIVE.run_generic(NORM.name, base)
    assert len(resolved) == 1 and NATIVE.generic_record_count() == 1
    above = float(torch.nextafter(torch.tensor(1e-6, dtype=torch.float64),
                                  torch.tensor(1.0, dtype=torch.float64)))  # fmt: skip
    variants = [
        [x, w, torch.bfloat16, above, True],
        [x, None, torch.bfloat16, 1e-6, True],
        [x, w.float(), torch.bfloat16, 1e-6, True],
        [x, w, torch.bfloat16, 1e-6, False],
        [x, w, torch.float32, 1e-6, True],
        [_misaligned((4, 64), torch.bfloat16), w, torch.bfloat16, 1e-6, True],
        [x.float(), w, torch.bfloat16, 1e-6, True],
    ]
    for i, args in enumerate(variants, 2):
        NATIVE.run_generic(NORM.name, args)
        assert NATIVE.generic_record_count() == i, args
    assert len(set(resolved)) == len(resolved) == 1 + len(variants)


def test_the_example_softmax_runs_on_the_generic_kernel(paths):
    """The example's two ops are all declarations: their CUDA kernel is the C++ one (no
    Python per call), and it launches what the Python path launches."""
    log, _, _ = paths
    ex = import_example(keep_kernels=False)
    assert ex.softmax.generic_native and ex.softmax.backward.generic_native
    x = _aligned((6, 256), torch.bfloat16)
    cpp, py, (y,), _ = _both(ex.softmax, (x,), log)
    assert cpp == py and cpp[0][2] == ["x", "y", 6]
    dy = _aligned((6, 256), torch.bfloat16)
    cpp, py, _, _ = _both(ex.softmax.backward, (y, dy), log)
    assert cpp == py and cpp[0][2] == ["y", "dy", "dx", 6]
    dump = torch._C._dispatch_dump("user_softmax::softmax")
    cuda = [line for line in dump.splitlines() if line.startswith("CUDA")]
    assert cuda and "generic.h" in cuda[0], dump


def test_a_value_python_computes_keeps_the_python_launch():
    """Launch(values=...) is a Python function of the call: the op's CUDA kernel stays the
    Python launch path (C++ cannot compute it), and says so."""
    name = "kbuild_generic_test::computed"
    op = opdef.DEFINED.get(name) or Op(
        name,
        args=(Rows("x"), Feature("weight")),
        outputs=(Out("y", like="x"), Out("stats", rows="x")),
        launch=Launch(
            NORMISH,
            values={
                "store_stats": lambda b: True,
                "eps": lambda b: 0.5,
                "out_dtype": lambda b: "f32",
            },
        ),
        reference=lambda x, weight: (x, x.float().mean(-1)),
    )
    assert op.native_program() is None and not op.generic_native
    dump = torch._C._dispatch_dump(name).splitlines()
    cuda = [line for line in dump if line.startswith("CUDA")]
    assert cuda and "generic.h" not in cuda[0]


def test_a_pointer_without_a_tensor_is_an_error_naming_it(paths, monkeypatch):
    """A kernel asking for a tensor the call did not give (a declaration where the table's
    `when` and the op's optional tensor disagree) must raise, not pass a null pointer."""
    log, _, _ = paths
    always = KernelDef(
        "generic_test_always_weight",
        "tests.nowhere:build",
        NORMISH.params,
        (Arg("x"), Arg("weight"), Arg("y"), Arg("stats", when="store_stats"), Arg("M", "i64")),
    )
    name = "kbuild_generic_test::always_weight"
    op = opdef.DEFINED.get(name) or Op(
        name,
        args=NORM.args,
        outputs=NORM.outputs,
        launch=Launch(always),
        reference=NORM.reference,
    )
    args = [_aligned((2, 8), torch.float32), None, torch.float32, 1e-6, False]
    with pytest.raises(ValueError, match="argument weight has no tensor"):
        NATIVE.run_generic(name, args)
    with pytest.raises(ValueError, match="argument weight has no tensor"):
        op._launch_cuda(*args)


# A row kernel whose output dtype is a parameter of its own (a cast): the op's optional dtype
# scalar picks it, None meaning x's dtype (Out's rule, the fake's and the Python path's).
CAST = KernelDef(
    "generic_test_cast",
    "tests.nowhere:build",
    (Param("N", "int"), Param("dtype", "dtype"), Param("y_dtype", "dtype")),
    (Arg("x"), Arg("y"), Arg("M", "i64")),
)


def test_an_output_dtype_argument_of_none_is_the_like_tensors_dtype(paths):
    """Out(dtype=<an optional dtype scalar>) given None is allocated in its `like` tensor's
    dtype, on both paths: the C++ kernel read None as a dtype (an internal assert of torch's)."""
    log, _, _ = paths
    name = "kbuild_generic_test::cast"
    op = opdef.DEFINED.get(name) or Op(
        name,
        args=(Rows("x"), Scalar("out_dtype", "dtype", None, optional=True)),
        outputs=(Out("y", like="x", dtype="out_dtype"),),
        launch=Launch(CAST),
        reference=lambda x, out_dtype: x.to(out_dtype or x.dtype),
    )
    assert op.generic_native
    x = _aligned((4, 16), torch.bfloat16)
    for out_dtype, want in ((None, torch.bfloat16), (torch.float32, torch.float32)):
        cpp, py, (a,), (b,) = _both(op, (x, out_dtype), log)
        assert cpp == py and cpp[0][2] == ["x", "y", 4]
        assert a.dtype == b.dtype == want and a.shape == b.shape == x.shape
        assert f"y_dtype={DTYPE_NAMES[want]}" in cpp[0][0]


def test_an_optional_scalar_keying_a_kernel_keeps_the_python_launch(paths):
    """An optional float (or int, bool) scalar given None has no bits in the C++ key: the C++
    kernel read None as a double (torch's internal assert, "please report a bug to PyTorch").
    Such an op keeps the Python launch path, where the table's check names the parameter."""
    name = "kbuild_generic_test::optional_eps"
    op = opdef.DEFINED.get(name) or Op(
        name,
        args=(
            Rows("x"),
            Feature("weight"),
            Scalar("out_dtype", "dtype"),
            Scalar("eps", "float", None, optional=True),
            Scalar("store_stats", "bool", False),
        ),
        outputs=NORM.outputs,
        launch=Launch(NORMISH),
        reference=NORM.reference,
    )
    assert op.native_program() is None and not op.generic_native
    x = _aligned((4, 16), torch.bfloat16)
    with pytest.raises(TypeError, match="eps must be float, got None"):
        op._launch_cuda(x, None, torch.bfloat16, None, False)


# A row kernel with ids, one per row (a cross-entropy's targets): an "index" parameter.
CE_LIKE = KernelDef(
    "generic_test_ce",
    "tests.nowhere:build",
    (
        Param("N", "int"),
        Param("dtype", "dtype"),
        Param("targets_dtype", "index"),
        Param("vectorize", "bool", True, vectors_of=("dtype",)),
    ),
    (Arg("logits"), Arg("targets"), Arg("loss"), Arg("M", "i64")),
)


def _ce_op() -> Op:
    name = "kbuild_generic_test::ce"
    return opdef.DEFINED.get(name) or Op(
        name,
        args=(Rows("logits"), Ids("targets", rows_of="logits")),
        outputs=(Out("loss", rows="logits"),),
        launch=Launch(CE_LIKE),
        reference=lambda logits, targets: torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), targets.flatten().long(), reduction="none"
        ),
    )


def test_ids_bind_an_index_parameter_on_both_paths(paths):
    """Integer ids (Ids) give the kernel's "index" parameter (i32 / i64), in the key too: a
    key without it would hand int64 targets to the kernel built for int32 ones."""
    log, resolved, _ = paths
    op = _ce_op()
    assert op.generic_native
    logits = _aligned((2, 3, 32), torch.bfloat16)
    for index in (torch.int32, torch.int64):
        targets = torch.randint(0, 32, (2, 3), dtype=index)
        cpp, py, cpp_out, py_out = _both(op, (logits, targets), log)
        assert cpp == py and cpp[0][2] == ["logits", "targets", "loss", 6]
        suffix = "i32" if index == torch.int32 else "i64"
        assert f"targets_dtype={suffix}" in cpp[0][0]
        assert cpp_out[0].shape == (6,) and cpp_out[0].dtype == torch.float32
    assert NATIVE.generic_record_count() == 2


@pytest.mark.parametrize(
    "targets, error, words",
    [
        (torch.zeros(2, 3), TypeError,
         "targets must be torch.int32 or torch.int64 ids; got torch.float32"),
        (torch.zeros(6, dtype=torch.int64), ValueError,
         "targets must have logits's shape without its last dimension (2, 3); got (6,)"),
        ([0, 1], TypeError, "targets must be a torch.Tensor, got list"),
    ],
)  # fmt: skip
def test_ids_are_checked_by_name(targets, error, words):
    """A float target, or one per element rather than per row, read as ids would index
    garbage: refused by name before anything runs."""
    op = _ce_op()
    with pytest.raises(error) as caught:
        op(torch.zeros(2, 3, 32), targets)
    assert str(caught.value) == words


def test_warm_specs_cover_both_index_dtypes():
    """`kbuild warmup --ops` of an op taking ids warms the kernel for int32 and for int64 ids
    (a cache warmed for one misses on a model passing the other)."""
    specs = [s.short() for s in _ce_op().warm_specs(512, "bf16", misaligned=False)]
    assert specs == [
        "generic_test_ce(N=512, dtype=bf16, targets_dtype=i32, vectorize=True)",
        "generic_test_ce(N=512, dtype=bf16, targets_dtype=i64, vectorize=True)",
    ]
