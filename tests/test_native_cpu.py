"""The C++ hot path (kbuild/native) checked on CPU: it asks for the kernels the Python launch
path asks for, launches them the same way, and resolves each kernel once.

The extension's CUDA kernels are called directly (not through the dispatcher) on CPU tensors,
with a launch hook that records each launch instead of calling the driver, and with the fake
memory tier of launch_recorder behind the resolver. The Python launch functions run on the
same inputs against the same fake tier. Both must request the same specs, in the same order,
with the same grids and the same arguments (each pointer named by the tensor it belongs to).
Catches: a table value the C++ side drops or mixes up (eps, a dtype, vectorize: a wrong
kernel or a stale record), a slot written to the wrong argument, a wrong persistent grid or
workspace, a column sum of the wrong planes, a record resolved on every call.

Also here: the extension builds (CPU CI compiles it), its value names and kinds are the
kernel table's and its other tables match resolve.py's, every value it sets splits its key,
errors from the resolver keep their Python type, and the autograd it registers is what runs.
"""

from __future__ import annotations

import math

import pytest
import torch

import kbuild as kbuild_ref
from kbuild import native
from kbuild.kernels import resolve
from kbuild.kernels.norms import api
from kbuild.op.tensors import readable_rows
from kbuild.registry import group_magic, kernel_def

from .launch_recorder import TORCH, Tier, install, layernorm, rmsnorm
from .launch_recorder import encoder as encoder_ops
from .launch_recorder import zeros as _t

# Built and loaded on a CPU too (by default only a CUDA call loads it): its kernels run here
# through the launch hook.
NATIVE = native.load(force=True)
# not_interpreted: KBUILD_INTERPRET turns the extension off (the Python launch path runs)
pytestmark = [
    pytest.mark.skipif(NATIVE is None, reason="the C++ extension is unavailable"),
    pytest.mark.not_interpreted,
]


class Recorder:
    """A fake tier whose launchers carry what resolve.launch_record reads, and a log of every
    launch from either path as (spec, grid, args)."""

    def __init__(self, monkeypatch):
        self.tier = Tier()
        self.launches: list = []
        self.by_name: dict = {}
        install(monkeypatch, self.get_launcher, self.tier.loaded)

    def get_launcher(self, key, device, make_spec):
        launcher = self.tier.get_launcher(key, device, make_spec)
        spec = launcher.spec
        launcher.names = kernel_def(spec.kernel).arg_names(spec)
        launcher.function_handle, launcher.block, launcher.dynamic_shared = 0, 128, 0
        launcher.meta = {
            "columns_per_block": 32,
            "grid": "persistent" if "bwd" in spec.kernel else "rows",
            "spec": {"kernel": spec.short()},
        }
        launches = self.launches

        def call(launcher, grid, stream, *args):
            launches.append((launcher.spec, grid, list(args)))

        launcher.__class__ = type("Logged", (type(launcher),), {"__call__": call})
        self.by_name[spec.short()] = spec
        return launcher

    def hook(self, name, grid, args):
        self.launches.append((self.by_name[name], grid, list(args)))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder(monkeypatch)
    NATIVE.clear_records()
    NATIVE.set_launch_hook(rec.hook)
    yield rec
    NATIVE.set_launch_hook(None)
    NATIVE.clear_records()


def _outputs(result) -> list:
    """A call's returned tensors in order (a tensor, a tuple or list of them, or None)."""
    if result is None:
        return []
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _labelled(launches, tensors, outputs=None):
    """Each launch with its pointer arguments named by the input tensor they point into;
    integer arguments (M, R, ...) kept as they are. With `outputs` (what the call returned):
    a pointer to one of them is "out<k>", k its place in the returned tuple, and any other
    pointer (a workspace) "new<k>" in the order the log first shows it, so two outputs or
    two workspaces written the other way round differ; without: "new" for all those."""
    named = {t.data_ptr(): name for name, t in tensors.items() if t is not None}
    for k, t in enumerate(outputs or []):
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            named.setdefault(t.data_ptr(), f"out{k}")
    fresh: dict = {}

    def label(address):
        if address in named:
            return named[address]
        if outputs is None:
            return "new"
        return fresh.setdefault(address, f"new{len(fresh)}")

    out = []
    for spec, grid, args in launches:
        kdef = kernel_def(spec.kernel)
        kinds = {a.name: a.kind for a in kdef.args}
        names = kdef.arg_names(spec)
        assert len(names) == len(args), (spec.short(), names, args)
        labels = [
            a if kinds[name] == "i64" else label(a) for name, a in zip(names, args, strict=True)
        ]
        out.append((spec, grid, labels))
    return out


def _both(recorder, python_call, native_call, tensors):
    """Run the Python path, then the native one; return both launch logs, each labelled by
    the inputs and by that call's own returned tensors (the calls return in the same order),
    so an output pointer in the other output's slot shows."""
    result = _outputs(python_call())
    python_log = _labelled(recorder.launches, tensors, result)
    recorder.launches.clear()
    native = _outputs(native_call())
    assert len(native) == len(result)
    return python_log, _labelled(recorder.launches, tensors, native)


def _inputs(M, N, dtype, wdtype, misaligned=()):
    return {
        name: _t((M, N), dtype, name in misaligned) for name in ("x", "residual", "dy", "dres")
    } | {
        "weight": None if wdtype is None else _t((N,), wdtype, "weight" in misaligned),
        "bias": None if wdtype is None else _t((N,), wdtype),
        "rstd": torch.zeros(M),
        "mean": torch.zeros(M),
    }


CASES = [
    # M, N, dtype, weight dtype, misaligned inputs
    (3, 64, "bf16", "bf16", ()),
    (7, 96, "f16", "f32", ()),
    (5, 64, "f32", None, ()),
    (9, 40, "bf16", "bf16", ("x",)),  # misaligned x: no vector accesses
    (2, 1000, "bf16", "f32", ("weight",)),
]


@pytest.mark.parametrize("M, N, dtype, wdtype, off", CASES)
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_forward_launches_match_python(recorder, M, N, dtype, wdtype, off, store, eps):
    t = _inputs(M, N, dtype, wdtype, off)
    x, r, w, b = t["x"], t["residual"], t["weight"], t["bias"]
    for py_call, native_call in (
        (
            lambda: rmsnorm.rmsnorm_fwd(x, w, eps, store),
            lambda: NATIVE.rmsnorm_fwd_cuda(x, w, eps, store),
        ),
        (
            lambda: layernorm.layernorm_fwd(x, w, b, eps, store),
            lambda: NATIVE.layernorm_fwd_cuda(x, w, b, eps, store),
        ),
        (
            lambda: rmsnorm.fused_add_rmsnorm_fwd(x, r, w, eps, torch.float32, store),
            lambda: NATIVE.fused_add_rmsnorm_fwd_cuda(x, r, w, eps, torch.float32, store),
        ),
    ):
        python_log, native_log = _both(recorder, py_call, native_call, t)
        assert native_log == python_log
        assert len(native_log) == 1
        recorder.launches.clear()


@pytest.mark.parametrize("M, N, dtype, wdtype, off", CASES)
@pytest.mark.parametrize("need_dw", [True, False])
def test_backward_launches_match_python(recorder, M, N, dtype, wdtype, off, need_dw):
    t = _inputs(M, N, dtype, wdtype, off)
    x, dy, w, b, rstd, mean = t["x"], t["dy"], t["weight"], t["bias"], t["rstd"], t["mean"]
    calls = [
        (
            lambda: rmsnorm.rmsnorm_bwd(dy, x, w, rstd, need_dw),
            lambda: NATIVE.rmsnorm_bwd_cuda(dy, x, w, rstd, True, need_dw),
        ),
        (
            lambda: rmsnorm.fused_add_rmsnorm_bwd(dy, t["dres"], x, w, rstd, need_dw),
            lambda: NATIVE.fused_add_rmsnorm_bwd_cuda(dy, t["dres"], x, w, rstd, need_dw),
        ),
        (
            lambda: rmsnorm.fused_add_rmsnorm_bwd(dy, None, x, w, rstd, need_dw),
            lambda: NATIVE.fused_add_rmsnorm_bwd_cuda(dy, None, x, w, rstd, need_dw),
        ),
    ]
    for need_db in (True, False):
        calls.append(
            (
                lambda need_db=need_db: layernorm.layernorm_bwd(
                    dy, x, w, mean, rstd, need_dw, b, need_db
                ),
                lambda need_db=need_db: NATIVE.layernorm_bwd_cuda(
                    dy, x, w, b, mean, rstd, True, need_dw, need_db
                ),
            )
        )
    for py_call, native_call in calls:
        python_log, native_log = _both(recorder, py_call, native_call, t)
        assert native_log == python_log
        wanted = w is not None and need_dw
        assert [spec.kernel for spec, _, _ in native_log][1:] == ["column_sum"] * (
            len(native_log) - 1
        )
        assert len(native_log) >= 1 + wanted
        recorder.launches.clear()


def test_each_output_pointer_is_the_output_it_names(recorder):
    """Catches two outputs' pointers swapped in a launch (LayerNorm's mean and rstd, the
    fused form's residual_out and rstd, dw and db in the column sum): every argument is named
    by the returned tensor it points to, on both paths, not "new" for all of them."""
    t = _inputs(3, 64, "bf16", "bf16")
    x, r, w, b, dy = t["x"], t["residual"], t["weight"], t["bias"], t["dy"]
    cases = [
        (
            lambda: layernorm.layernorm_fwd(x, w, b, 1e-5, True),
            lambda: NATIVE.layernorm_fwd_cuda(x, w, b, 1e-5, True),
            {"y": "out0", "mean": "out1", "rstd": "out2"},
        ),
        (
            lambda: rmsnorm.fused_add_rmsnorm_fwd(x, r, w, 1e-6, torch.float32, True),
            lambda: NATIVE.fused_add_rmsnorm_fwd_cuda(x, r, w, 1e-6, torch.float32, True),
            {"y": "out0", "residual_out": "out1", "rstd": "out2"},
        ),
        (
            lambda: layernorm.layernorm_bwd(dy, x, w, t["mean"], t["rstd"], True, b, True),
            lambda: NATIVE.layernorm_bwd_cuda(dy, x, w, b, t["mean"], t["rstd"], True, True, True),
            {
                "dx": "out0",
                "dw_partial": "new0",
                "db_partial": "new1",
                "out": "out1",
                "out1": "out2",
            },
        ),
    ]
    for py_call, native_call, wanted in cases:
        python_log, native_log = _both(recorder, py_call, native_call, t)
        for log in (python_log, native_log):
            named = {
                name: label
                for spec, _, labels in log
                for name, label in zip(kernel_def(spec.kernel).arg_names(spec), labels, strict=True)
                if name in wanted
            }
            assert named == wanted
        assert native_log == python_log
        recorder.launches.clear()


def test_mixed_dtype_parameters_sum_in_two_launches(recorder):
    """dw in fp32 and db in bf16 cannot share a column-sum launch: one each, planes=1."""
    M, N = 6, 64
    x, dy = _t((M, N), "bf16"), _t((M, N), "bf16")
    w, b = _t((N,), "f32"), _t((N,), "bf16")
    stats = torch.zeros(M)
    dx, dw, db = NATIVE.layernorm_bwd_cuda(dy, x, w, b, stats, stats, True, True, True)
    sums = [spec for spec, _, _ in recorder.launches if spec.kernel == "column_sum"]
    assert [(s.kwargs["out_dtype"], s.kwargs.get("planes", 1)) for s in sums] == [
        ("f32", 1),
        ("bf16", 1),
    ]
    assert (dw.dtype, db.dtype, dx.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)


def test_each_kernel_is_resolved_once(recorder, monkeypatch):
    """Repeated calls of one shape hit the extension's records; eps or N changes miss."""
    seen = []

    def counting(kernel, device, values):
        seen.append(kernel)
        return resolve.resolve(kernel, device, values)

    NATIVE.set_resolver(counting)
    try:
        x, w = _t((4, 64), "bf16"), _t((64,), "bf16")
        for _ in range(5):
            NATIVE.rmsnorm_fwd_cuda(x, w, 1e-6, True)
        assert seen == ["rmsnorm_fwd"]
        NATIVE.rmsnorm_fwd_cuda(x, w, 1e-5, True)
        NATIVE.rmsnorm_fwd_cuda(_t((4, 128), "bf16"), _t((128,), "bf16"), 1e-5, True)
        assert seen == ["rmsnorm_fwd"] * 3
        for _ in range(3):
            NATIVE.rmsnorm_bwd_cuda(x, x, w, torch.zeros(4), True, True)
        assert seen[3:] == ["rmsnorm_bwd", "column_sum"]
        assert NATIVE.record_count() == 5
    finally:
        NATIVE.set_resolver(resolve.resolve)


def test_resolver_errors_keep_their_type(recorder):
    """An offline miss raised in the resolver reaches the caller as itself, not as a
    RuntimeError with the text flattened (the message names the warmup command)."""

    class Missing(LookupError):
        pass

    def failing(kernel, device, values):
        raise Missing(f"kernel {kernel} is not in the cache")

    NATIVE.set_resolver(failing)
    try:
        with pytest.raises(Missing, match="kernel rmsnorm_fwd is not in the cache"):
            NATIVE.rmsnorm_fwd_cuda(_t((4, 64), "bf16"), None, 1e-6, False)
    finally:
        NATIVE.set_resolver(resolve.resolve)


def test_empty_inputs_launch_nothing(recorder):
    x = _t((0, 64), "bf16")
    y, rstd = NATIVE.rmsnorm_fwd_cuda(x, None, 1e-6, True)
    assert y.shape == (0, 64) and rstd.shape == (0,)
    dx, dw = NATIVE.rmsnorm_bwd_cuda(x, x, _t((64,), "f32"), rstd, True, True)
    assert torch.equal(dw, torch.zeros(64)) and dw.dtype == torch.float32
    y, mean, rstd = NATIVE.layernorm_fwd_cuda(_t((3, 0), "bf16"), None, None, 1e-5, True)
    assert rstd.isnan().all() and mean.shape == (3,)
    assert recorder.launches == []


def test_bad_statistics_are_refused(recorder):
    """A backward given the empty stats of a forward run without storing them is refused
    with the fix in the message, never launched over a buffer too small."""
    x = _t((4, 64), "bf16")
    with pytest.raises(ValueError, match="store_rstd=True"):
        NATIVE.rmsnorm_bwd_cuda(x, x, None, torch.zeros(0), True, False)
    assert recorder.launches == []


def test_tables_match_resolve():
    assert list(NATIVE.slot_names) == list(resolve.SLOT_NAMES)
    assert list(NATIVE.kernel_names) == list(resolve.KERNELS)


def test_values_are_the_tables_parameters():
    """The names a key's values are set by, and their kinds, are the kernel table's: every
    parameter of every native kernel, in the order they first appear, one kind per name.
    Catches a parameter added to the table that the extension cannot key (its calls would all
    get the default), a renamed one, and a value encoded as another kind (eps as an int)."""
    assert list(zip(NATIVE.value_names, NATIVE.value_kinds, strict=True)) == list(
        resolve.VALUE_KINDS.items()
    )
    for kernel in resolve.KERNELS.values():
        for p in kernel.params:
            assert resolve.VALUE_KINDS[p.name] == p.kind, (kernel.name, p.name)


def test_the_resolver_takes_values_by_name():
    """Values not given take the table's defaults (and trailing ones stay out of the
    memory-tier key, as the Python launch functions leave them); a name the kernel does not
    have is an error, not a value dropped."""
    rms = resolve.KERNELS["rmsnorm_fwd"]
    given = {"N": 64, "dtype": "bf16", "weight_dtype": None, "store_rstd": True, "eps": 1e-6}
    assert resolve.table_values(rms, given) == (64, "bf16", None, True, 1e-6)
    assert resolve.table_values(rms, given | {"strided": True}) == (
        (64, "bf16", None, True, 1e-6, True, 0.0, True)
    )
    with pytest.raises(ValueError, match="no parameter"):
        resolve.table_values(rms, given | {"planes": 2})
    with pytest.raises(TypeError, match="missing parameter 'eps'"):
        resolve.resolve("rmsnorm_fwd", -1, {k: v for k, v in given.items() if k != "eps"})


def test_every_table_argument_has_a_slot():
    """A kernel the extension launches has every argument in a slot (trace builds aside)."""
    for kernel in resolve.KERNELS.values():
        names = {a.name for a in kernel.args} - {"trace"}
        assert names <= set(resolve.SLOTS), kernel.name


def test_public_api_routes_cuda_through_the_extension():
    assert api._native is NATIVE


def test_autograd_is_the_extensions():
    """The forward ops' Autograd kernel is the C++ one (no Python autograd registered), and
    it computes the gradients the reference does on CPU."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("kbuild::rmsnorm_bwd", "Autograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kbuild::rmsnorm_fwd", "Autograd")
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    y, _ = torch.ops.kbuild.rmsnorm_fwd(x.float(), w.float(), 1e-6, True)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w
    dy = torch.randn(3, 16, dtype=torch.float64)
    got = torch.autograd.grad(y, [x, w], dy.float())
    want = torch.autograd.grad(ref, [x, w], dy)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


# --- the public entries: the common case whole in C++, everything else declined ------------


@pytest.fixture
def hooked(recorder):
    """The entries take CPU tensors (running the CPU kernels) while the launch hook is set."""
    return recorder


def test_entries_compute_what_the_python_path_does(hooked, monkeypatch):
    """Forward values, the statistics stored exactly when a gradient is needed, and the
    gradients, through the C++ entries and autograd, against the public Python path."""
    monkeypatch.setattr(api, "_native", None)  # kbuild_ref.*: the Python path (reference)
    x = torch.randn(5, 48, requires_grad=True)
    r = torch.randn(5, 48, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48))
    b = torch.randn(48, requires_grad=True)
    dy = torch.randn(5, 48)
    cases = [
        (lambda: NATIVE.rmsnorm(x, w, 1e-2), lambda: kbuild_ref.rmsnorm(x, w, 1e-2), [x, w]),
        (
            lambda: NATIVE.layernorm(x, w, b, 1e-2),
            lambda: kbuild_ref.layernorm(x, w, b, 1e-2),
            [x, w, b],
        ),
        (
            lambda: NATIVE.fused_add_rmsnorm(x, r, w, 1e-2, False, True),
            lambda: kbuild_ref.fused_add_rmsnorm(x, r, w, 1e-2, False, True),
            [x, r, w],
        ),
    ]
    for native_call, python_call, inputs in cases:
        got, want = native_call(), python_call()
        torch.testing.assert_close(got, want)
        for g, e in zip(
            torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy), strict=True
        ):
            torch.testing.assert_close(g, e)
    out, res = NATIVE.fused_add_rmsnorm(x, r, w, 1e-2, True, True)
    assert res.dtype == torch.float32
    torch.testing.assert_close(res, x.detach() + r.detach())
    with torch.no_grad():
        assert NATIVE.rmsnorm(x, w, 1e-2).grad_fn is None


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(lambda x, w: (x, w, 1), id="int eps"),
        pytest.param(lambda x, w: (x, w, -1.0), id="negative eps"),
        pytest.param(lambda x, w: (x, w, float("inf")), id="inf eps"),
        pytest.param(lambda x, w: (x, w[:-1], 1e-6), id="short weight"),
        pytest.param(lambda x, w: (x, w.double(), 1e-6), id="f64 weight"),
        pytest.param(lambda x, w: (x, torch.randn(96)[::2], 1e-6), id="strided weight"),
        pytest.param(lambda x, w: (x.double(), None, 1e-6), id="f64 x"),
        pytest.param(lambda x, w: (x[0, 0], None, 1e-6), id="scalar x"),
        pytest.param(lambda x, w: (x.numpy(), None, 1e-6), id="not a tensor"),
        pytest.param(
            lambda x, w: (torch.masked.as_masked_tensor(x, x > 0), None, 1e-6), id="tensor subclass"
        ),
    ],
)
def test_entries_decline_all_but_the_common_case(hooked, args):
    """Declined (None): the Python path then raises its messages or takes the subclass."""
    x, w = torch.randn(4, 48), torch.randn(48)
    assert NATIVE.rmsnorm(*args(x, w)) is None
    a = args(x, w)
    assert NATIVE.layernorm(a[0], a[1], None, a[2]) is None


def test_fused_entry_declines_bad_flags_and_residuals(hooked):
    x, w = torch.randn(4, 48), torch.randn(48)
    assert NATIVE.fused_add_rmsnorm(x, x, w, 1e-6, 1, False) is None
    assert NATIVE.fused_add_rmsnorm(x, x, w, 1e-6, True, None) is None
    assert NATIVE.fused_add_rmsnorm(x, x[:2], w, 1e-6, True, False) is None
    assert NATIVE.fused_add_rmsnorm(x, x.half(), w, 1e-6, True, False) is None
    assert NATIVE.fused_add_rmsnorm(x, x, w, 1e-6, True, False) is not None


def test_entries_decline_cpu_tensors_without_the_hook():
    x = torch.randn(4, 48)
    assert NATIVE.rmsnorm(x, None, 1e-6) is None
    assert NATIVE.layernorm(x, None, None, 1e-6) is None
    assert NATIVE.fused_add_rmsnorm(x, x, None, 1e-6, True, False) is None


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "fused_add_rmsnorm"])
def test_backward_materialises_no_zeros(op):
    """The statistics outputs (rstd, mean) never get gradients: autograd must not make zero
    tensors for them (on the GPU each is an allocation and a fill kernel per backward)."""
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    if op == "rmsnorm":
        y = torch.ops.kbuild.rmsnorm_fwd(x, w, 1e-6, True)[0]
    elif op == "layernorm":
        y = torch.ops.kbuild.layernorm_fwd(x, w, w, 1e-5, True)[0]
    else:
        y = torch.ops.kbuild.fused_add_rmsnorm_fwd(x, x, w, 1e-6, torch.float32, True)[0]
    dy = torch.randn(4, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(y, [x, w], dy)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::zeros", "aten::zeros_like", "aten::zero_"}, names


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "fused_add_rmsnorm"])
def test_statistics_stay_out_of_the_autograd_graph(op):
    """The forward ops' statistics are returned beside the outputs, not as outputs of the C++
    autograd Function (a saved output is rebuilt at every unpack: host time torch's norms do
    not pay): they carry no grad_fn, the Function's node takes only the differentiable
    outputs' gradients, and each call returns its own statistics (the hand-over slot is
    emptied, never read stale). Gradients are those of the reference."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    ops = torch.ops.kbuild
    calls = {
        "rmsnorm": lambda x: ops.rmsnorm_fwd(x, w, 1e-6, True),
        "layernorm": lambda x: ops.layernorm_fwd(x, w, w, 1e-5, True),
        "fused_add_rmsnorm": lambda x: ops.fused_add_rmsnorm_fwd(
            x, x, w, 1e-6, torch.float32, True
        ),
    }
    first = calls[op](x)
    second = calls[op](2 * x.detach().requires_grad_())
    outputs, stats = (first[:2], first[2:]) if op == "fused_add_rmsnorm" else (first[:1], first[1:])
    assert all(s.grad_fn is None and not s.requires_grad for s in stats)
    assert all(o.grad_fn is outputs[0].grad_fn for o in outputs)
    assert len(outputs[0].grad_fn._input_metadata) == len(outputs)  # no slots for stats
    assert len(outputs[0].grad_fn.next_functions) >= 2  # x and w
    rstd = first[-1]
    torch.testing.assert_close(rstd, 2 * second[-1], rtol=1e-4, atol=0)  # rstd(2x) = rstd(x) / 2
    dy = torch.randn(4, 32)
    got = torch.autograd.grad(outputs[0], [x, w], dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    if op == "layernorm":
        ref = torch.nn.functional.layer_norm(xr, (32,), wr, wr, 1e-5)
    else:
        xs = 2 * xr if op == "fused_add_rmsnorm" else xr
        ref = torch.nn.functional.rms_norm(xs, (32,), wr, 1e-6)
    want = torch.autograd.grad(ref, [xr, wr], dy.double())
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


# --- kbuild.linear and the bias gradient ---------------------------------------------------


@pytest.mark.parametrize(
    "M, OC, dtype, offset",
    [
        (300, 768, "bf16", False),
        (64, 40, "f32", False),
        (7, 96, "f16", True),
        (1000, 4096, "bf16", False),
    ],
)
def test_bias_grad_launches_match_python(recorder, monkeypatch, M, OC, dtype, offset):
    """The same bias_grad spec, chunk grid, rows per chunk and column sum as the Python
    launch (kernels/llmc/launch.py), with the device's multiprocessor count from the resolver: a
    C++ chunking that drifted from bias_chunks would sum in another order (other bits).
    (1000, 4096): fewer chunks than M // 64 allows, so the per-multiprocessor target shows."""
    monkeypatch.setattr(encoder_ops, "multiprocessors", lambda device: 132)
    dout = _t((M, OC), dtype, offset)
    python_log, native_log = _both(
        recorder,
        lambda: encoder_ops.bias_grad(dout),
        lambda: NATIVE.bias_grad_cuda(dout),
        {"dout": dout},
    )
    assert native_log == python_log
    assert [spec.kernel for spec, _, _ in native_log] == ["bias_grad", "column_sum"]
    assert native_log[0][2][0] == "dout" and native_log[0][0].kwargs["vectorize"] == (not offset)


def test_bias_grad_of_no_rows_is_zero(recorder):
    db = NATIVE.bias_grad_cuda(_t((0, 48), "bf16"))
    assert torch.equal(db, torch.zeros(48, dtype=torch.bfloat16))
    assert recorder.launches == []


def test_linear_entry_computes_what_the_python_path_does(hooked, monkeypatch):
    """Forward and all three gradients of the C++ LinearFunction (its dbias through the
    kbuild::bias_grad operator, here its CPU kernel) against the Python LinearFunction and
    torch's linear, for a 3-D input as GPT-2's layers give it."""
    monkeypatch.setattr(api, "_native", None)
    x = torch.randn(2, 5, 24, dtype=torch.float64).float().requires_grad_()
    w = torch.nn.Parameter(torch.randn(12, 24))
    b = torch.nn.Parameter(torch.randn(12))
    dy = torch.randn(2, 5, 12)
    got = NATIVE.linear(x, w, b)
    assert "LinearFunction" in got.grad_fn.name()  # the C++ node, not the Python one
    want = kbuild_ref.linear(x, w, b)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(got, ref)
    grads = torch.autograd.grad(got, [x, w, b], dy)
    for g, e, r in zip(
        grads,
        torch.autograd.grad(want, [x, w, b], dy),
        torch.autograd.grad(ref, [x, w, b], dy),
        strict=True,
    ):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(g, r)
    # only x needs a gradient: no dweight, no dbias computed
    (dx,) = torch.autograd.grad(NATIVE.linear(x, w.detach(), b), [x], dy)
    torch.testing.assert_close(dx, grads[0])
    with torch.no_grad():
        assert NATIVE.linear(x, w, b).grad_fn is None


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(lambda x, w, b: (x, w, None), id="no bias"),
        pytest.param(lambda x, w, b: (x, w.t(), b), id="transposed weight"),
        pytest.param(lambda x, w, b: (x, w, b[:-1]), id="short bias"),
        pytest.param(lambda x, w, b: (x, w.double(), b), id="f64 weight"),
        pytest.param(lambda x, w, b: (x.half(), w, b), id="mixed dtypes"),
        pytest.param(lambda x, w, b: (x, w[None], b), id="3-D weight"),
        pytest.param(lambda x, w, b: (x.numpy(), w, b), id="not a tensor"),
    ],
)
def test_linear_entry_declines_all_but_the_common_case(hooked, args):
    x, w, b = torch.randn(4, 24), torch.randn(12, 24), torch.randn(12)
    assert NATIVE.linear(*args(x, w, b)) is None
    assert NATIVE.linear(x, w, b) is not None


def test_linear_entry_declines_autocast(hooked):
    """Under autocast the Python LinearFunction runs (it replays the autocast state in the
    backward and accepts fp32 master weights)."""
    x, w, b = torch.randn(4, 24), torch.randn(12, 24), torch.randn(12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert NATIVE.linear(x, w, b) is None


def test_bias_grad_has_the_extensions_cuda_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kbuild::bias_grad", "CUDA")
    assert kbuild_ref.linear.__module__ == "kbuild.kernels.llmc.op"


# --- the weight offset ----------------------------------------------------------------------


def test_offset_launches_match_python(recorder):
    """The offset reaches the spec of every RMSNorm kernel, forward and backward, the same on
    both paths; a record keyed without it would launch offset 0's kernel for offset 1."""
    t = _inputs(6, 64, "bf16", "bf16")
    x, r, w, dy, rstd = t["x"], t["residual"], t["weight"], t["dy"], t["rstd"]
    bf16 = torch.bfloat16
    for c in (0.0, 1.0):
        calls = [
            (lambda c=c: rmsnorm.rmsnorm_fwd(x, w, 1e-6, True, c),
             lambda c=c: NATIVE.rmsnorm_fwd_cuda(x, w, 1e-6, True, c)),
            (lambda c=c: rmsnorm.fused_add_rmsnorm_fwd(x, r, w, 1e-6, bf16, True, c),
             lambda c=c: NATIVE.fused_add_rmsnorm_fwd_cuda(x, r, w, 1e-6, bf16, True, c)),
            (lambda c=c: rmsnorm.rmsnorm_bwd(dy, x, w, rstd, True, c),
             lambda c=c: NATIVE.rmsnorm_bwd_cuda(dy, x, w, rstd, True, True, c)),
            (lambda c=c: rmsnorm.fused_add_rmsnorm_bwd(dy, None, x, w, rstd, True, c),
             lambda c=c: NATIVE.fused_add_rmsnorm_bwd_cuda(dy, None, x, w, rstd, True, c)),
        ]  # fmt: skip
        for py_call, native_call in calls:
            python_log, native_log = _both(recorder, py_call, native_call, t)
            assert native_log == python_log
            assert native_log[0][0].kwargs.get("offset", 0.0) == c
            recorder.launches.clear()


def test_entries_take_the_offset(hooked, monkeypatch):
    """The entries pass the offset through (forward and, saved, to the backward) and decline
    what the Python checks must refuse."""
    monkeypatch.setattr(api, "_native", None)
    x = torch.randn(5, 48, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48) * 0.01)
    dy = torch.randn(5, 48)
    for native_call, python_call in (
        (lambda: NATIVE.rmsnorm(x, w, 1e-6, 1.0), lambda: kbuild_ref.rmsnorm(x, w, 1e-6, 1.0)),
        (
            lambda: NATIVE.fused_add_rmsnorm(x, x, w, 1e-6, False, False, 1.0),
            lambda: kbuild_ref.fused_add_rmsnorm(x, x, w, 1e-6, False, False, 1.0),
        ),
    ):
        got, want = native_call(), python_call()
        torch.testing.assert_close(got, want)
        for g, e in zip(
            torch.autograd.grad(got, [x, w], dy), torch.autograd.grad(want, [x, w], dy), strict=True
        ):
            torch.testing.assert_close(g, e)
    assert torch.equal(NATIVE.rmsnorm(x, w, 1e-6, None), NATIVE.rmsnorm(x, w, 1e-6, 0.0))
    for bad in (1, float("inf"), float("nan"), True):
        assert NATIVE.rmsnorm(x, w, 1e-6, bad) is None
    assert NATIVE.rmsnorm(x, None, 1e-6, 1.0) is None  # an offset with no weight: an error


def test_fp32_residual_stream_launches_match_python(recorder):
    """An fp32 residual with a bf16 x: the forward reads it as fp32 (residual_in_dtype) and
    the backward writes d(residual) in fp32 beside dx (dresidual_dtype, its own pointer), on
    both paths alike; keyed apart from the bf16-residual kernels."""
    t = _inputs(6, 64, "bf16", "bf16")
    x, w, dy, rstd = t["x"], t["weight"], t["dy"], t["rstd"]
    r32 = _t((6, 64), "f32")
    res_out, dres = _t((6, 64), "f32"), _t((6, 64), "f32")
    tensors = t | {"r32": r32, "res_out": res_out, "dres32": dres}
    f32 = torch.float32
    python_log, native_log = _both(
        recorder,
        lambda: rmsnorm.fused_add_rmsnorm_fwd(x, r32, w, 1e-6, f32, True),
        lambda: NATIVE.fused_add_rmsnorm_fwd_cuda(x, r32, w, 1e-6, f32, True),
        tensors,
    )
    assert native_log == python_log
    assert python_log[0][0].kwargs["residual_in_dtype"] == "f32" and python_log[0][2][1] == "r32"
    recorder.launches.clear()
    out = {}

    def native():
        out["native"] = NATIVE.fused_add_rmsnorm_bwd_cuda(
            dy, dres, res_out, w, rstd, True, 0.0, f32
        )
        return out["native"]

    def python():
        out["python"] = rmsnorm.fused_add_rmsnorm_bwd(dy, dres, res_out, w, rstd, True, 0.0, f32)
        return out["python"]

    python_log, native_log = _both(recorder, python, native, tensors)
    assert native_log == python_log
    spec, _, args = native_log[0]
    assert spec.kwargs["dresidual_dtype"] == "f32"
    assert kernel_def(spec.kernel).arg_names(spec)[5:7] == ["dx", "dresidual"]
    for dx, dres_in, _ in out.values():
        assert dx.dtype == torch.bfloat16 and dres_in.dtype == f32 and dres_in.shape == dy.shape
    with pytest.raises(TypeError, match="float32 residual_out"):
        NATIVE.fused_add_rmsnorm_fwd_cuda(x, r32, w, 1e-6, torch.bfloat16, True)


def test_fused_entry_continues_an_fp32_stream(hooked, monkeypatch):
    """The entry takes a bf16 x with an fp32 residual (the stream of a call with
    residual_in_fp32) and gives what the Python path gives: an fp32 stream, and the
    residual's gradient in fp32."""
    monkeypatch.setattr(api, "_native", None)
    x = torch.randn(5, 48).bfloat16().requires_grad_()
    r = torch.randn(5, 48, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48))
    got = NATIVE.fused_add_rmsnorm(x, r, w, 1e-6, True, False)
    want = kbuild_ref.fused_add_rmsnorm(x, r, w, 1e-6)
    assert got[1].dtype == want[1].dtype == torch.float32
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)
    dy = torch.randn(5, 48).bfloat16()
    g1 = torch.autograd.grad(got[0], [x, r, w], dy)
    g2 = torch.autograd.grad(want[0], [x, r, w], dy)
    assert g1[1].dtype == torch.float32
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_an_offset_without_a_weight_is_no_kernel_of_its_own(recorder):
    """Catches a spec keyed by an offset that scales nothing: a second, identical kernel that
    no manifest lists (an offline miss). Both paths launch the plain kernel."""
    x = _t((4, 64), "bf16")
    t = {"x": x}
    for py_call, native_call in (
        (lambda: rmsnorm.rmsnorm_fwd(x, None, 1e-6, True, 1.0),
         lambda: NATIVE.rmsnorm_fwd_cuda(x, None, 1e-6, True, 1.0)),
        (lambda: rmsnorm.rmsnorm_bwd(x, x, None, torch.zeros(4), False, 1.0),
         lambda: NATIVE.rmsnorm_bwd_cuda(x, x, None, torch.zeros(4), True, False, 1.0)),
    ):  # fmt: skip
        python_log, native_log = _both(recorder, py_call, native_call, t)
        assert native_log == python_log
        assert "offset" not in native_log[0][0].kwargs
        recorder.launches.clear()


def test_the_stream_checks_agree(recorder):
    """An fp32 residual with a 16-bit residual_out, or a 16-bit separate residual gradient:
    refused by the C++ kernels, the Python launches and the CPU op alike, naming the argument."""
    x, r32, w = _t((4, 64), "bf16"), _t((4, 64), "f32"), _t((64,), "bf16")
    with pytest.raises(TypeError, match="residual"):
        NATIVE.fused_add_rmsnorm_fwd_cuda(x, r32, w, 1e-6, torch.bfloat16, True)
    with pytest.raises(TypeError, match="residual_dtype float32"):
        torch.ops.kbuild.fused_add_rmsnorm_fwd(x, r32, w, 1e-6, torch.bfloat16, True)
    rstd = torch.zeros(4)
    with pytest.raises(TypeError, match="residual_dtype must be None or"):
        NATIVE.fused_add_rmsnorm_bwd_cuda(x, None, x, w, rstd, True, 0.0, torch.bfloat16)
    with pytest.raises(TypeError, match="residual_dtype must be None or"):
        rmsnorm.fused_add_rmsnorm_bwd(x, None, x, w, rstd, True, 0.0, torch.bfloat16)


def _qkv(B, T, H, D, dtype, pad=0):
    """A fused qkv projection's output (B, T, 3 * H * D + pad) and its q as a (B, T, H, D)
    view: H contiguous rows of D per token, the tokens 3 * H * D + pad elements apart."""
    qkv = _t((B, T, 3 * H * D + pad), dtype)
    return qkv, qkv[..., : 3 * H * D].view(B, T, 3, H, D)[:, :, 0]


# (name, x, the (x_group, x_stride) a launch must pass; None: dense rows, no strided kernel)
_B, _T, _H, _D = 2, 3, 4, 64
STRIDED = [
    ("qkv view", _qkv(_B, _T, _H, _D, "bf16")[1], (_H, 3 * _H * _D)),
    ("rows of a wider matrix", _t((6, 96), "bf16")[:, :_D], (1, 96)),
    ("one broadcast row", _t((_D,), "f32").expand(5, _D), (1, 0)),
    ("odd stride: no vectors", _qkv(_B, _T, _H, _D, "bf16", pad=1)[1], (_H, 3 * _H * _D + 1)),
]


@pytest.mark.parametrize("name, x, layout", STRIDED, ids=[s[0] for s in STRIDED])
def test_strided_rows_are_read_in_place(recorder, name, x, layout):
    """RMSNorm's x of grouped rows (a (B, T, H, D) q of a fused qkv, rows at one stride, a
    broadcast row) is launched in place, its (x_group, x_stride) after M, by both paths,
    forward and backward; the stride's alignment decides the vector kernel. Catches a copy
    made anyway (x would be a "new" pointer), a stride or group the two paths derive
    differently, and a misaligned stride launched with vector loads."""
    N = x.shape[-1]
    M = x.numel() // N
    w = _t((N,), x.dtype)
    dy, rstd = _t(x.shape, x.dtype), torch.zeros(M)
    t = {"x": x, "weight": w, "dy": dy, "rstd": rstd}
    for py_call, native_call in (
        (
            lambda: rmsnorm.rmsnorm_fwd(x, w, 1e-6, True),
            lambda: NATIVE.rmsnorm_fwd_cuda(x, w, 1e-6, True),
        ),
        (
            lambda: rmsnorm.rmsnorm_bwd(dy, x, w, rstd, True),
            lambda: NATIVE.rmsnorm_bwd_cuda(dy, x, w, rstd, True, True),
        ),
    ):
        python_log, native_log = _both(recorder, py_call, native_call, t)
        assert native_log == python_log
        spec, _, args = native_log[0]
        assert args[0] == "x"  # read in place, never copied
        if layout is None:
            assert "strided" not in spec.kwargs and args[-1] == M
        else:
            assert spec.kwargs["strided"] is True and args[-4:-1] == [M, *layout]
            assert args[-1] == group_magic(layout[0])
            stride_bytes = layout[1] * x.element_size()
            assert spec.kwargs["vectorize"] == (stride_bytes % 16 == 0 and N % 8 == 0)
        recorder.launches.clear()


def test_unreadable_rows_are_copied_once(recorder):
    """Rows that do not lie at one stride (q of a qkv transposed to (B, H, T, D), three
    levels) are made contiguous: the launch reads a new tensor, dense, not strided; the
    Python path's backward, given that x as saved (kbuild::rmsnorm_fwd called by name),
    copies it as the C++ one does rather than failing."""
    q = _qkv(_B, _T, _H, _D, "bf16")[1].transpose(1, 2)
    M = _B * _T * _H
    w, dy, rstd = _t((_D,), "bf16"), _t(q.shape, "bf16"), torch.zeros(M)
    for call in (
        lambda: rmsnorm.rmsnorm_fwd(readable_rows(q), None, 1e-6, False),
        lambda: NATIVE.rmsnorm_fwd_cuda(q, None, 1e-6, False),
        lambda: rmsnorm.rmsnorm_bwd(dy, q, w, rstd, True),
        lambda: NATIVE.rmsnorm_bwd_cuda(dy, q, w, rstd, True, True),
    ):
        call()
    labelled = _labelled(recorder.launches, {"x": q, "weight": w, "dy": dy, "rstd": rstd})
    (py_spec, _, py_args), (spec, _, args) = labelled[:2]
    assert spec == py_spec and "strided" not in spec.kwargs
    assert args[0] == "new" and args[-1] == M
    backward = [launch for launch in labelled[2:] if launch[0].kernel == "rmsnorm_bwd"]
    (py_spec, _, py_args), (spec, _, args) = backward
    assert spec == py_spec and "strided" not in spec.kwargs
    assert args[0] == py_args[0] == "new"


# --- the keys: every table value the extension sets splits its key ---------------------------


def _rows(M, N, dtype, vectorize=True, strided=False):
    """x of M rows: misaligned (no vector accesses) unless `vectorize`; `strided`: the rows
    of a wider matrix (read in place at a stride: the strided kernels)."""
    if strided:
        return _t((M, 2 * N), dtype)[:, :N]
    return _t((M, N), dtype, not vectorize)


# Native calls of each kernel that take its table values by name (the defaults: one kernel),
# so that a test can vary one.
def _rmsnorm_fwd(
    N=64,
    dtype="bf16",
    weight_dtype="f32",
    store_rstd=True,
    eps=1e-6,
    vectorize=True,
    offset=0.0,
    strided=False,
):
    x = _rows(4, N, dtype, vectorize, strided)
    NATIVE.rmsnorm_fwd_cuda(x, _t((N,), weight_dtype), eps, store_rstd, offset)


def _fused_add_rmsnorm_fwd(
    N=64,
    dtype="bf16",
    weight_dtype="f32",
    residual_dtype="f32",
    store_rstd=True,
    eps=1e-6,
    vectorize=True,
    offset=0.0,
    residual_in_dtype=None,
):
    x, r = _rows(4, N, dtype, vectorize), _t((4, N), residual_in_dtype or dtype)
    w = _t((N,), weight_dtype)
    NATIVE.fused_add_rmsnorm_fwd_cuda(x, r, w, eps, TORCH[residual_dtype], store_rstd, offset)


def _layernorm_fwd(
    N=64,
    dtype="bf16",
    weight_dtype="f32",
    bias_dtype="f32",
    store_stats=True,
    eps=1e-5,
    vectorize=True,
):
    x = _rows(4, N, dtype, vectorize)
    NATIVE.layernorm_fwd_cuda(x, _t((N,), weight_dtype), _t((N,), bias_dtype), eps, store_stats)


def _rmsnorm_bwd(
    N=64,
    dtype="bf16",
    weight_dtype="f32",
    compute_dw=True,
    vectorize=True,
    offset=0.0,
    strided=False,
):
    x, dy = _rows(4, N, dtype, vectorize, strided), _t((4, N), dtype)
    w = _t((N,), weight_dtype)
    NATIVE.rmsnorm_bwd_cuda(dy, x, w, torch.zeros(4), True, compute_dw, offset)


def _fused_add_rmsnorm_bwd(
    N=64,
    dtype="bf16",
    weight_dtype="f32",
    residual_dtype="bf16",
    has_dresidual_out=True,
    compute_dw=True,
    vectorize=True,
    offset=0.0,
    dresidual_dtype=None,
):
    dy, res_out = _rows(4, N, dtype, vectorize), _t((4, N), residual_dtype)
    dres = _t((4, N), residual_dtype) if has_dresidual_out else None
    w, rstd = _t((N,), weight_dtype), torch.zeros(4)
    stream = TORCH.get(dresidual_dtype)
    NATIVE.fused_add_rmsnorm_bwd_cuda(dy, dres, res_out, w, rstd, compute_dw, offset, stream)


def _layernorm_bwd(
    N=64, dtype="bf16", weight_dtype="f32", compute_dw=True, compute_db=True, vectorize=True
):
    x, dy, w = _rows(4, N, dtype, vectorize), _t((4, N), dtype), _t((N,), weight_dtype)
    stats = torch.zeros(4)
    NATIVE.layernorm_bwd_cuda(dy, x, w, _t((N,), "f32"), stats, stats, True, compute_dw, compute_db)


def _column_sum(N=64, out_dtype="f32", planes=1):
    """dw, and db too for two planes (of one dtype), of a LayerNorm backward."""
    x, w, stats = _t((4, N), out_dtype), _t((N,), out_dtype), torch.zeros(4)
    NATIVE.layernorm_bwd_cuda(x, x, w, w, stats, stats, True, True, planes == 2)


def _bias_grad(OC=64, dtype="bf16", vectorize=True):
    NATIVE.bias_grad_cuda(_t((100, OC), dtype, not vectorize))


_EPS = (1e-6, math.nextafter(1e-6, 1.0), 1e-5)  # keyed by their bits: 1e-6's neighbour too
_DTYPES, _WEIGHTS = ("bf16", "f16", "f32"), (None, "bf16", "f32")
_FLAG = (True, False)
# Each native kernel: a native call taking the kernel's parameter values by name, and values
# of each parameter (the others at the call's defaults) that make distinct kernels.
KEY_VALUES = {
    "rmsnorm_fwd": (_rmsnorm_fwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "store_rstd": _FLAG,
        "eps": _EPS, "vectorize": _FLAG, "offset": (0.0, 1.0), "strided": (False, True),
    }),
    "fused_add_rmsnorm_fwd": (_fused_add_rmsnorm_fwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "residual_dtype": _DTYPES,
        "store_rstd": _FLAG, "eps": _EPS, "vectorize": _FLAG, "offset": (0.0, 1.0),
        "residual_in_dtype": (None, "f32"),
    }),
    "layernorm_fwd": (_layernorm_fwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "bias_dtype": _WEIGHTS,
        "store_stats": _FLAG, "eps": _EPS, "vectorize": _FLAG,
    }),
    "rmsnorm_bwd": (_rmsnorm_bwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "compute_dw": _FLAG,
        "vectorize": _FLAG, "offset": (0.0, 1.0), "strided": (False, True),
    }),
    "fused_add_rmsnorm_bwd": (_fused_add_rmsnorm_bwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "residual_dtype": _DTYPES,
        "has_dresidual_out": _FLAG, "compute_dw": _FLAG, "vectorize": _FLAG,
        "offset": (0.0, 1.0), "dresidual_dtype": (None, "f32"),
    }),
    "layernorm_bwd": (_layernorm_bwd, {
        "N": (64, 128), "dtype": _DTYPES, "weight_dtype": _WEIGHTS, "compute_dw": _FLAG,
        "compute_db": _FLAG, "vectorize": _FLAG,
    }),
    "column_sum": (_column_sum, {"N": (64, 128), "out_dtype": _DTYPES, "planes": (1, 2)}),
    "bias_grad": (_bias_grad, {"OC": (64, 128), "dtype": _DTYPES, "vectorize": _FLAG}),
}  # fmt: skip


def test_every_parameter_of_a_native_kernel_is_varied():
    for kernel in resolve.KERNELS.values():
        assert set(KEY_VALUES[kernel.name][1]) == {p.name for p in kernel.params}, kernel.name


@pytest.mark.parametrize(
    "kernel, param",
    [(kernel, param) for kernel, (_, values) in KEY_VALUES.items() for param in values],
    ids=lambda v: v,
)
def test_every_value_splits_the_key(recorder, monkeypatch, kernel, param):
    """Calls that differ in one table value of a kernel make a record each and launch the
    kernel of that value; run again, each hits its record. Catches a value the key leaves out
    (or reads into another): the second call would launch the first call's kernel."""
    monkeypatch.setattr(encoder_ops, "multiprocessors", lambda device: 132)  # the bias gradient's
    call, values = KEY_VALUES[kernel]
    default = next(p.default for p in kernel_def(kernel).params if p.name == param)
    for value in values[param]:
        before = NATIVE.record_count()
        recorder.launches.clear()
        call(**{param: value})
        spec = next(spec for spec, _, _ in recorder.launches if spec.kernel == kernel)
        assert spec.kwargs.get(param, default) == value
        assert NATIVE.record_count() > before, (param, value)
    count = NATIVE.record_count()
    for value in values[param]:
        call(**{param: value})
    assert NATIVE.record_count() == count


def test_the_resolver_loads_by_the_python_paths_key(recorder):
    """The resolver asks the memory tier with the key the Python launch function uses (the
    table's values as that function gives them): a process running both paths loads each
    kernel once. (An offset without a weight is the exception: the key zeroes it.)"""
    t = _inputs(6, 64, "bf16", "bf16")
    x, r, w, b, dy = (t[k] for k in ("x", "residual", "weight", "bias", "dy"))
    rstd, mean = t["rstd"], t["mean"]
    strided = _rows(6, 64, "bf16", strided=True)
    f32 = torch.float32
    calls = [
        (lambda: rmsnorm.rmsnorm_fwd(x, w, 1e-6, True, 1.0),
         lambda: NATIVE.rmsnorm_fwd_cuda(x, w, 1e-6, True, 1.0)),
        (lambda: rmsnorm.rmsnorm_fwd(strided, None, 1e-6, False),
         lambda: NATIVE.rmsnorm_fwd_cuda(strided, None, 1e-6, False)),
        (lambda: rmsnorm.fused_add_rmsnorm_fwd(x, _t((6, 64), "f32"), w, 1e-6, f32, True),
         lambda: NATIVE.fused_add_rmsnorm_fwd_cuda(x, _t((6, 64), "f32"), w, 1e-6, f32, True)),
        (lambda: layernorm.layernorm_fwd(x, w, None, 1e-5, True),
         lambda: NATIVE.layernorm_fwd_cuda(x, w, None, 1e-5, True)),
        (lambda: rmsnorm.rmsnorm_bwd(dy, strided, w, rstd, True),
         lambda: NATIVE.rmsnorm_bwd_cuda(dy, strided, w, rstd, True, True)),
        (lambda: rmsnorm.fused_add_rmsnorm_bwd(dy, r, x, w, rstd, True, 0.0, f32),
         lambda: NATIVE.fused_add_rmsnorm_bwd_cuda(dy, r, x, w, rstd, True, 0.0, f32)),
        (lambda: layernorm.layernorm_bwd(dy, x, w, mean, rstd, True, b, True),
         lambda: NATIVE.layernorm_bwd_cuda(dy, x, w, b, mean, rstd, True, True, True)),
    ]  # fmt: skip
    for py_call, native_call in calls:
        recorder.tier.requests.clear()
        py_call()
        python_keys = [key for key, _, _ in recorder.tier.requests]
        recorder.tier.requests.clear()
        NATIVE.clear_records()
        native_call()
        assert [key for key, _, _ in recorder.tier.requests] == python_keys
