"""One kernel per name, option set and launch-plan branch of the tests and bench manifests,
for sm_90 and gfx942, plus the example's kernels and the tests' own, run on the interpreter
through the op that launches it, at a few rows, against fp64.

The manifests' specs are grouped by kernel and every parameter but the row width (the table's
first: N, C, OC, D). Within a group each width takes the plan its builder chooses for the
target (`plan_branch`: rows held in registers, several a block, split over a cluster or walked
in chunks, peeled, scalar, and each plan field that selects other code: a persistent grid,
staged rows, prefetch, shared partials, held parameters, the cluster exchange), and the
narrowest width of each branch represents it. tests/manifest_sweep.py maps each
representative to the public op call that launches it and runs the calls interpreted, in one
child process per arch (KBUILD_INTERPRET), both at once, with KBUILD_RECORD on: every call is
held to fp64 (a test each), and the record must hold every representative, so the sweep ran
each kernel it claims. A call the interpreter's race check stops runs again with the check
off: its values still count, and the race fails it all the same.
Sized for CI: about 1230 representatives in 950 calls on sm_90, 1190 in 900 on gfx942, 2.9
min on two cores (2026-12-07); most of it builds kernels, and rows of 65536 and more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

import pytest

from kbuild.cli.manifest import manifest
from kbuild.spec import KernelSpec

from .manifest_sweep import Call, call_for

pytest.importorskip("mlir")

from kbuild.kernels.llmc.encoder import columns_shape  # noqa: E402
from kbuild.kernels.norms import backward as norm_backward  # noqa: E402
from kbuild.kernels.norms import forward as norm_forward
from kbuild.plan import rows as row_plan  # noqa: E402
from kbuild.plan.config import RowConfig  # noqa: E402
from kbuild.registry import (
    get_builder,  # noqa: E402
    kernel_def,  # noqa: E402
)
from kbuild.targets import Target, target_for_arch  # noqa: E402

from .examples import import_example  # noqa: E402

ARCHES = ("sm_90", "gfx942")
ROOT = Path(__file__).resolve().parents[1]
# The tests' own kernels whose builders compute something, one call each (the fault kernels
# of test_interpreter_cpu.py run interpreted there): test_row_api_cpu.py's loss kernel, on
# rows split over a cluster and peeled on sm_90, and test_user_kernels_cpu.py's user module.
OWN_CALLS = (Call.make("row_api_nll", 50257, index="i64"), Call.make("user_scale", 1000))


# ----------------------------------------------------------------------------- plans


class _Planned(Exception):
    """Raised inside a builder with the plan it chose: nothing after it (MLIR) is built."""

    def __init__(self, plan):
        self.plan = plan


def _stopping(choose):
    def chosen(*args, **kwargs):
        raise _Planned(choose(*args, **kwargs))

    return chosen


# Where the row kernels' builders choose their plans: the norms' forward and backward, and
# row_plan.row_kernel (cross-entropy, the activations, the example) calling plan_rows.
PLANNERS = ((norm_forward, "plan_forward"), (norm_backward, "plan_backward"),
            (row_plan, "plan_rows"))  # fmt: skip


def row_plan_of(spec: KernelSpec, target: Target):
    """The launch plan `spec`'s builder chooses on `target`, from the builder itself: run up
    to the plan and stopped there."""
    with contextlib.ExitStack() as stack:
        for module, name in PLANNERS:
            stack.enter_context(mock.patch.object(module, name, _stopping(getattr(module, name))))
        try:
            get_builder(spec.kernel)(**spec.kwargs, target=target)
        except _Planned as planned:
            return planned.plan
    raise AssertionError(f"{spec.short()}: its builder chose no row plan")


def row_paths(row: RowConfig) -> tuple[str, ...]:
    """The code a row shape selects (dsl.rows), not how many threads or vectors it takes.
    Column guards are no branch of the plan: they follow from the width."""
    paths = {
        "rows share a block": row.rows_per_block > 1,
        "split over a cluster": row.cluster > 1,
        "chunked": row.chunked,
        "peeled": row.peel,
        "scalar": row.vec == 1,
    }
    return tuple(name for name, taken in paths.items() if taken)


def plan_branch(spec: KernelSpec, target: Target) -> tuple[str, ...]:
    """The launch-plan branch `spec` takes on `target`: the code paths its plan selects (the
    plan's fields by name where they are set; not the .minnctapersm hint)."""
    p = spec.kwargs
    if spec.kernel.startswith("encoder_"):  # a row of C columns a block (kernels/llmc/encoder.py)
        return row_paths(columns_shape(p["C"], p["dtype"], p["vectorize"]))
    if spec.kernel == "column_sum":  # 4 columns a thread where N allows (kernels/reduce.py)
        return ("scalar",) if p["N"] % 4 else ()
    if spec.kernel in ("bias_grad", "rope"):  # one shape at any width (the bias gradient's
        return ()  # vector width is its vectorize parameter; rope: heads of 64 here)
    plan = row_plan_of(spec, target)
    fields = [f.name for f in dataclasses.fields(plan) if f.name not in ("row", "blocks_per_sm")]
    return row_paths(plan.row) + tuple(f"{f}={getattr(plan, f)}" for f in fields
                                       if getattr(plan, f))  # fmt: skip


# ----------------------------------------------------------------------------- the sweep


@dataclasses.dataclass
class Sweep:
    """The representatives of one arch and the calls that launch them."""

    representatives: dict[KernelSpec, tuple[str, ...]]  # spec -> its plan branch
    calls: dict[Call, list[KernelSpec]]  # call -> the representatives it launches


@functools.cache
def manifest_specs() -> tuple[KernelSpec, ...]:
    """The specs swept: the tests and bench manifests' and the example's warm list. Not the
    tune and trace manifests' own: they force launch-plan fields (bench/tune.py's
    alternatives to the chooser's picks) or build with per-row timestamps (bench/trace_rows.py),
    which no op launches; the standard manifest's are all in the tests manifest."""
    example = import_example(keep_kernels=False).warmup_specs()
    return tuple(dict.fromkeys([*manifest("tests"), *manifest("bench"), *example]))


@functools.cache
def sweep(arch: str) -> Sweep:
    target = target_for_arch(arch)
    specs = manifest_specs()
    import_example()  # its kernels in the registry while their plans are taken
    try:
        narrowest: dict[tuple, KernelSpec] = {}
        branches = {}
        for spec in specs:
            width = kernel_def(spec.kernel).params[0].name
            options = tuple((k, v) for k, v in spec.params if k != width)
            branch = branches[spec] = plan_branch(spec, target)
            key = (spec.kernel, options, branch)
            if key not in narrowest or spec[width] < narrowest[key][width]:
                narrowest[key] = spec
    finally:
        import_example(keep_kernels=False)
    calls: dict[Call, list[KernelSpec]] = defaultdict(list)
    for spec in narrowest.values():
        calls[call_for(spec)].append(spec)
    for call in list(calls):  # a forward that a training step of the sweep launches anyway
        training = next((t for t in call.trainings() if t in calls), None)
        if training is not None:
            calls[training] += calls.pop(call)
    for call in OWN_CALLS:
        calls[call] = []
    return Sweep({s: branches[s] for s in narrowest.values()}, dict(calls))


def _calls() -> list:
    params = []
    for arch in ARCHES:
        for call in sweep(arch).calls:
            params.append(pytest.param(arch, call, id=f"{arch}-{call.label}"))
    return params


# ----------------------------------------------------------------------------- the tests


@dataclasses.dataclass
class Swept:
    """What one arch's worker reported."""

    results: dict[str, dict]  # call label -> its result line (manifest_sweep.run)
    launched: set[KernelSpec]  # KBUILD_RECORD's
    log: str  # the tail of its output


@pytest.fixture(scope="module")
def swept(subprocess_env, tmp_path_factory) -> dict[str, Swept]:
    """Both arches' calls run, each arch in a worker of its own, the two at once."""
    folder = tmp_path_factory.mktemp("manifest_sweep")
    workers = {}
    try:
        for arch in ARCHES:
            calls = folder / f"{arch}.json"
            calls.write_text(json.dumps([call.to_json() for call in sweep(arch).calls]))
            env = dict(subprocess_env, KBUILD_INTERPRET=arch,
                       KBUILD_RECORD=str(folder / f"{arch}.record"))  # fmt: skip
            log = open(folder / f"{arch}.log", "w")  # noqa: SIM115 (closed below)
            command = [sys.executable, "-m", "tests.manifest_sweep", str(calls),
                       str(folder / f"{arch}.jsonl")]  # fmt: skip
            worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
            workers[arch] = worker, log
        for worker, _ in workers.values():
            worker.wait(timeout=900)
    finally:
        for worker, log in workers.values():
            worker.kill()  # (one that has exited is left as it is)
            log.close()
    out = {}
    for arch in ARCHES:
        results = folder / f"{arch}.jsonl"
        lines = results.read_text().splitlines() if results.exists() else []
        record = folder / f"{arch}.record"
        launched = record.read_text().splitlines() if record.exists() else []
        out[arch] = Swept({r["label"]: r for r in map(json.loads, lines)},
                          {KernelSpec.from_json(json.loads(line)) for line in launched},
                          (folder / f"{arch}.log").read_text()[-3000:])  # fmt: skip
    return out


@pytest.mark.parametrize("arch, call", _calls())
def test_the_call_matches_fp64_interpreted(swept, arch, call):
    result = swept[arch].results.get(call.label)
    assert result is not None, f"the worker never finished this call:\n{swept[arch].log}"
    what = ", ".join(s.short() for s in sweep(arch).calls[call]) or "a test's own kernel"
    values = result.get("without_race_check", result["error"])
    assert values is None, f"{what}:\n{values}"
    race = result["error"]
    assert race is None, f"{what}: the values hold, the race check failed:\n{race}"


@pytest.mark.parametrize("arch", ARCHES)
def test_the_calls_launched_every_representative(swept, arch):
    missing = sorted(
        s.short() for s in sweep(arch).representatives if s not in swept[arch].launched
    )
    assert not missing, f"{len(missing)} never launched: {missing[:10]}\n{swept[arch].log}"


# The plans' choices the representatives take on each arch: gfx942 has no clusters, no
# asynchronous copies into shared memory and no L2 prefetch, so its long rows are chunked.
CHOICES = {
    "sm_90": {"rows share a block", "split over a cluster", "chunked", "peeled", "scalar",
              "persistent=True", "stage=1", "stage=2", "prefetch=True", "prefetch_l2=True",
              "shared_partials=True", "resident_params=registers", "word_widening=True",
              "exchange=barrier", "exchange=mbarrier", "exchange=lagged"},
    "gfx942": {"rows share a block", "chunked", "peeled", "scalar", "prefetch=True",
               "shared_partials=True"},
}  # fmt: skip


@pytest.mark.parametrize("arch", ARCHES)
def test_the_representatives_take_every_choice_of_the_plans(arch):
    """Every kernel of the manifests and the example is represented, and the branches taken
    are every choice the plans make on the arch: a plan read wrongly here (every spec one
    branch) or a choice the chooser stopped making shows."""
    s = sweep(arch)
    assert {spec.kernel for spec in s.representatives} == {x.kernel for x in manifest_specs()}
    assert set().union(*s.representatives.values()) == CHOICES[arch]
