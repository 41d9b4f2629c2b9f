"""`kbuild` command line: warmup (ahead-of-time compile), demo (the main job), cache.

kbuild warmup --arch sm_90 --manifest tests --cache-dir .kbuild-aot
kbuild warmup --arch gfx942 --hidden 4096 --dtype bf16     # every kernel of a model width
kbuild warmup --hidden 2048 --head-dim 128                  # ... with a QK-norm (Qwen3)
kbuild warmup --vocab 128256 --vocab 50257                  # cross-entropy of these vocabularies
kbuild warmup --model config.json                           # a Hugging Face model's kernels
kbuild warmup --arch sm_90 --from run.jsonl                 # what KBUILD_RECORD=run.jsonl saw
kbuild demo                       # compile the standard set; with a GPU also run and time it
kbuild cache list | path | clear | info | export FILE | import FILE | prune --max-size 2G
kbuild show SPEC --ptx             # what a kernel became (--mlir --llvm --asm --sass)

An error is one line on stderr and a non-zero status (2: the arguments, 1: the work failed;
warmup names each kernel that failed to compile on a line of its own, compiles the others,
then counts the failures); output piped into `head` ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .. import _OPS as _PUBLIC_OPS
from ..cache import DiskCache
from ..spec import KernelSpec
from ..targets import target_for_arch
from .args import (
    CACHE_DIR_HELP,
    CLIError,
    Parser,
    cache_root,
    check_arch,
    finite_float,
    plural,
    positive_int,
)
from .cache import add_cache_parser
from .manifest import MANIFESTS, manifest
from .widths import DEFAULT_WIDTH_OPS, WIDTH_OPS


def import_user_module(name: str):
    """Import a module that declares kernels of its own (`kbuild.kernel`), by module name or
    by the path of its file (whose folder goes first on sys.path, as `python FILE` does)."""
    given = name
    path = Path(name).expanduser()
    if name.endswith(".py") or "/" in name or os.sep in name or path.is_file():  # a file
        path = path.absolute()
        if not path.is_file():
            raise CLIError(f"--module {given}: no such file")
        if path.suffix != ".py":
            raise CLIError(f"--module {given}: not a Python file (give FILE.py or a module name)")
        name = path.stem
        loaded = sys.modules.get(name)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "") != path:
            raise CLIError(f"--module {given}: a module named {name} is imported already")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and f"{name}.".startswith(f"{err.name}."):  # itself missing
            raise CLIError(
                f"--module {given}: no module named {name!r} here (give FILE.py or a module "
                "name Python can import)"
            ) from None
        raise CLIError(f"--module {given}: {type(err).__name__}: {err}", 1) from None
    except Exception as err:  # the user's code: a syntax error, a taken kernel name, ...
        raise CLIError(f"--module {given}: {type(err).__name__}: {err}", 1) from None


def _module_specs(name: str) -> list[KernelSpec]:
    """The specs a user module asks to warm (its `warmup_specs()`, if it has one)."""
    module = import_user_module(name)
    try:
        specs = list(getattr(module, "warmup_specs", list)())
    except Exception as err:
        raise CLIError(f"--module {name}: warmup_specs(): {type(err).__name__}: {err}", 1) from None
    wrong = [s for s in specs if not isinstance(s, KernelSpec)]
    if wrong:
        raise CLIError(f"--module {name}: warmup_specs() must give KernelSpecs, not {wrong[0]!r}")
    return specs


def _warm_one(
    spec_json: str, arch: str, root: str, modules: tuple[str, ...] = ()
) -> tuple[str, dict, bool, float]:
    """Compile one spec into the cache (a worker process, which imports the user modules
    first so their kernels are known); returns its label and metadata."""
    from ..jit import build_into

    for module in modules:
        import_user_module(module)

    spec, target = KernelSpec.from_json(json.loads(spec_json)), target_for_arch(arch)
    start = time.perf_counter()
    artifact, built = build_into(DiskCache(root), spec, target)
    return spec.short(), artifact.meta, built, 1e3 * (time.perf_counter() - start)


def _describe(label: str, meta: dict, built: bool, ms: float) -> str:
    state = f"compiled {meta['compile_ms']['total']:7.1f} ms" if built else f"cached   {ms:7.1f} ms"
    if "vgprs" in meta:  # AMD: registers by kind, LDS, and scratch (its spill signal)
        return (
            f"{state}  vgprs {meta['vgprs']:>3}  sgprs {meta['sgprs']:>3}  lds "
            f"{meta['lds_bytes']:>6}  scratch {meta['scratch_bytes']:>4}  {label}"
        )
    spills = meta.get("spill_stores", 0) + meta.get("spill_loads", 0)
    return f"{state}  regs {meta.get('registers', '?'):>3}  spills {spills:>3}  {label}"


def warmup(
    specs: list[KernelSpec],
    arch: str,
    root: str,
    jobs: int,
    modules: tuple[str, ...] = (),
    prog: str = "kbuild warmup",
) -> list[tuple]:
    """Compile `specs` for `arch` into `root`, printing a progress line per kernel; `modules`
    declare kernels of their own that the specs may name. A kernel that does not compile
    (CompileError) is one line on stderr, starting with `prog`, and the others are compiled
    all the same; then a CLIError (exit 1) counts the failures. A missing tool (ptxas) stops
    at once."""
    from ..compiler import CompileError
    from .model_specs import KERNEL_MODULES

    os.makedirs(root, exist_ok=True)
    results, failed = [], []
    # kbuild's own kernels outside the table (a manifest's patched models name them)
    modules = tuple(dict.fromkeys((*KERNEL_MODULES, *modules)))
    args = [(s.canonical_json(), arch, root, modules) for s in specs]
    width = len(str(len(specs)))

    def report(i: int, outcome: Callable[[], tuple]) -> None:
        try:
            result = outcome()
        except CompileError as err:
            failed.append(err)
            print(f"{prog}: {_one_line(err)}", file=sys.stderr, flush=True)
            return
        print(f"[{i:>{width}}/{len(specs)}] {arch}  {_describe(*result)}", flush=True)
        results.append(result)

    if jobs <= 1:  # in this process: nothing outlives it if it is killed
        for i, arg in enumerate(args, 1):
            report(i, lambda arg=arg: _warm_one(*arg))
    else:
        # forkserver, not fork: a caller may have threads (torch's, a test runner's), and a
        # forked child can block forever on a lock one of them held at the fork.
        context = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = [pool.submit(_warm_one, *arg) for arg in args]
            try:
                for i, future in enumerate(futures, 1):
                    report(i, future.result)
            finally:  # after an error other than a kernel's: the rest is not started
                for future in futures:
                    future.cancel()
    if failed:
        count = f"{len(failed)} of {plural(len(specs), 'kernel')}"
        raise CLIError(f"{count} failed to compile for {arch} (each named above)", 1)
    return results


# The modules declaring kbuild's own kbuild::* operators: those of the package's public ops
# (torch's; imported for --ops only)
OWN_OP_MODULES = tuple(sorted({f"kbuild.{module}" for module in _PUBLIC_OPS.values()}))


def _declared_op_specs(name: str, hidden: int, dtype: str) -> list[KernelSpec]:
    """The kernels a declared op (kbuild.Op, in a --module) and its backward launch at this
    width: what its launches ask for, on aligned rows."""
    if name.startswith("kbuild::"):  # kbuild's own: declared when their modules import
        for module in OWN_OP_MODULES:
            importlib.import_module(module)
    opdef = sys.modules.get("kbuild.op.opdef")  # imported by the module declaring the op
    op = None if opdef is None else opdef.DEFINED.get(name)
    if op is None:
        known = sorted(opdef.DEFINED) if opdef is not None else []
        raise CLIError(
            f"--ops {name}: no op of that name is declared (give the --module declaring it)"
            + (f"; declared: {', '.join(known)}" if known else "")
        )
    try:
        return op.warm_specs(hidden, dtype)
    except (ValueError, TypeError) as err:
        raise CLIError(f"--ops {name}: {err}", 1) from None


def _checked(specs: list[KernelSpec], origin: str) -> list[KernelSpec]:
    """`specs`, each of a known kernel with values its table entry takes (its parameters'
    kinds and bounds), else a CLIError naming `origin` (the option they came from), the
    kernel, the parameter and what it takes."""
    from ..registry import kernel_def

    for spec in specs:
        try:
            kernel_def(spec.kernel).spec(**spec.kwargs)
        except (ValueError, TypeError) as err:
            raise CLIError(f"{origin}: {err}") from None
    return specs


def _specs_from(args) -> list[KernelSpec]:
    from ..record import read_specs
    from .widths import for_width

    specs = [s for name in args.manifest or [] for s in manifest(name)]
    for name in args.module or []:  # a user's kernels, and the specs it asks to warm
        specs += _checked(_module_specs(name), f"--module {name}: warmup_specs()")
    for path in args.from_file or []:
        try:
            specs += _checked(read_specs(path), f"--from {path}")
        except FileNotFoundError:
            raise CLIError(
                f"--from {path}: no such file (KBUILD_RECORD writes it on a GPU run: a CPU "
                "run asks for no kernel)",
                1,
            ) from None
        except (OSError, ValueError) as err:
            raise CLIError(f"--from {path}: {err}", 1) from None
    if args.head_dim is not None and args.hidden is None:
        raise CLIError("--head-dim goes with --hidden (the model's width)")
    if args.ops is not None and args.hidden is None:
        raise CLIError("--ops goes with --hidden (the width to warm them at)")
    if args.hidden is not None:
        names = tuple(filter(None, (args.ops or ",".join(DEFAULT_WIDTH_OPS)).split(",")))
        declared = [name for name in names if "::" in name]  # kbuild.Op's of user modules
        ops = tuple(name for name in names if "::" not in name)
        try:
            specs += for_width(
                args.hidden,
                args.dtype,
                args.weight_dtype,
                ops,
                residual_fp32=args.residual_fp32,
                rms_offset=args.rms_offset,
                head_dim=args.head_dim,
            )
        except (ValueError, TypeError) as err:
            raise CLIError(f"--hidden: {err}") from None
        for name in declared:
            specs += _declared_op_specs(name, args.hidden, args.dtype)
    for path in args.model or []:
        from .model_specs import config_plan

        try:
            found, left_out = config_plan(path, args.dtype)
        except ValueError as err:
            raise CLIError(f"--model {err}") from None
        specs += found
        if left_out is not None:
            print(f"--model {path}: {left_out}")
    for V in args.vocab or []:
        from ..kernels.loss.kernels import vocab_specs

        try:
            specs += vocab_specs(V, (args.dtype,))
        except ValueError as err:
            raise CLIError(f"--vocab {V}: {err}") from None
    from .show import parse_spec  # (pure Python, as the rest of the CLI)

    for text in args.spec or []:
        if not text.lstrip().startswith("{"):  # a label, as warmup and show print it
            try:
                specs.append(parse_spec(text))
            except (ValueError, TypeError) as err:
                raise CLIError(f"--spec: {err}") from None
            continue
        try:
            spec = KernelSpec.from_json(json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CLIError(f"--spec is not a kernel spec ({err}): {text}") from None
        specs += _checked([spec], "--spec")  # a kernel of the user's needs its --module
    return list(dict.fromkeys(specs))


def _cmd_warmup(args) -> int:
    check_arch(args.arch)
    specs = _specs_from(args)
    if not specs:
        raise CLIError(
            "nothing to warm: give --manifest, --module, --spec, --from, --hidden, --vocab or "
            "--model"
        )
    root = cache_root(args)
    start = time.perf_counter()
    modules = tuple(args.module or ())
    if args.model:
        from .model_specs import KERNEL_MODULES

        modules += KERNEL_MODULES
    elif args.vocab:
        modules += ("kbuild.kernels.loss.kernels",)
    warmup(specs, args.arch, root, args.jobs, modules=modules)
    elapsed = time.perf_counter() - start
    print(f"{plural(len(specs), 'kernel')} for {args.arch} in {root} ({elapsed:.1f} s)")
    return 0


def _cmd_show(args) -> int:
    from .show import STAGES, parse_spec, stages

    check_arch(args.arch)
    for name in args.module or []:
        import_user_module(name)
    wanted = tuple(s for s in STAGES if getattr(args, s)) or ("ptx",)
    try:
        spec = parse_spec(args.spec)
    except (ValueError, TypeError) as err:
        raise CLIError(f"SPEC: {err}") from None
    try:
        texts = stages(spec, args.arch, wanted)
    except ValueError as err:
        raise CLIError(str(err)) from None
    for stage in wanted:
        if len(wanted) > 1:
            print(f"// ---- {stage} ({spec.short()}, {args.arch})")
        print(texts[stage])
    return 0


def _cmd_demo(args) -> int:
    check_arch(args.arch)
    root = cache_root(args)
    print(f"kbuild demo: the standard kernel set for {args.arch}, cache {root}")
    from .. import env

    if env.compiler_available():
        warmup(manifest("standard"), args.arch, root, args.jobs, prog="kbuild demo")
    else:
        print("MLIR is not installed here: running from the cache as it is")
    from .demo import run_on_gpu

    return run_on_gpu(root)


_JOBS_HELP = "compile this many kernels at once, one process each (default: the CPU count)"


def _add_module_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--module",
        action="append",
        metavar="MODULE",
        help=f"a module (name or FILE.py) declaring kernels of your own (kbuild.kernel): {what}",
    )


def _add_warmup_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", action="append", choices=sorted(MANIFESTS))
    _add_module_option(p, "its warmup_specs() are warmed, and --spec / --from may name its kernels")
    p.add_argument(
        "--spec", action="append", help="a spec as JSON (see warmup hints), or its label"
    )
    p.add_argument(
        "--from",
        dest="from_file",
        action="append",
        metavar="FILE",
        help="specs recorded with KBUILD_RECORD=FILE (JSON lines)",
    )
    p.add_argument("--hidden", type=positive_int, help="every kernel of a model of this width")
    p.add_argument(
        "--vocab",
        type=positive_int,
        action="append",
        metavar="V",
        help="every cross-entropy kernel of a vocabulary of V in --dtype (kbuild.cross_entropy, "
        "kbuild.linear_cross_entropy)",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="CONFIG.json",
        help="every kernel a training and an inference step of this Hugging Face model launch "
        "once kbuild.nn.patch has put kbuild into it, in --dtype (norms, rotary embedding, MLP "
        "activation, cross-entropy)",
    )
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    p.add_argument("--weight-dtype", choices=("bf16", "f16", "f32"))
    p.add_argument(
        "--ops",
        help=f"comma-separated, among {', '.join(WIDTH_OPS)} (encoder: GPT-2's "
        "embedding; linear: a GPT-2 block's bias gradients), or an op a --module declares "
        f"(kbuild.Op: namespace::name); with --hidden (default {','.join(DEFAULT_WIDTH_OPS)})",
    )
    p.add_argument("--residual-fp32", action="store_true")
    p.add_argument(
        "--rms-offset",
        type=finite_float,
        default=0.0,
        help="RMSNorm's weight offset (Gemma: 1.0) for --hidden",
    )
    p.add_argument(
        "--head-dim",
        type=positive_int,
        help="with --hidden: a QK-norm over heads of this width (Qwen3: 128)",
    )


def _parser() -> argparse.ArgumentParser:
    from ..version import __version__

    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="kbuild", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kbuild {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, helptext, example in (
        (
            "warmup",
            "compile kernels into the disk cache (no GPU needed)",
            "examples:\n  kbuild warmup --arch sm_90 --manifest tests --cache-dir DIR\n"
            "  kbuild warmup --arch gfx942 --hidden 4096 --dtype bf16 --weight-dtype f32\n"
            "  KBUILD_RECORD=run.jsonl python train.py; kbuild warmup --from run.jsonl",
        ),
        (
            "demo",
            "compile the standard kernels and, with a GPU, check and time them",
            "example:\n  kbuild demo --arch sm_90 --cache-dir DIR",
        ),
    ):
        p = sub.add_parser(name, help=helptext, epilog=example, formatter_class=raw)
        p.add_argument("--arch", default="sm_90", help="target arch (default sm_90)")
        p.add_argument("--cache-dir", help=CACHE_DIR_HELP)
        p.add_argument(
            "-j", "--jobs", type=positive_int, default=os.cpu_count() or 1, help=_JOBS_HELP
        )
        if name == "warmup":
            _add_warmup_options(p)
    p = sub.add_parser(
        "show",
        help="print what a kernel became: MLIR, LLVM, PTX or AMDGPU asm, SASS",
        epilog="examples:\n  kbuild show 'rmsnorm_fwd(N=4096, dtype=bf16, eps=1e-06, "
        "store_rstd=True, vectorize=True, weight_dtype=bf16)' --ptx\n"
        '  kbuild show \'{"kernel": "column_sum", "params": {"N": 1024, '
        '"out_dtype": "bf16"}}\' --asm --arch gfx942',
        formatter_class=raw,
    )
    p.add_argument("spec", help="a spec as JSON, or the label warmup prints")
    p.add_argument("--arch", default="sm_90", help="target arch (default sm_90)")
    _add_module_option(p, "for SPEC of a kernel of your own")
    for stage, what in (
        ("mlir", "the builder's MLIR"),
        ("llvm", "the LLVM dialect (NVIDIA) or LLVM IR (AMD)"),
        ("ptx", "PTX (NVIDIA; the default stage there)"),
        ("asm", "PTX on NVIDIA, AMDGPU assembly on AMD"),
        ("sass", "SASS (NVIDIA; needs ptxas and cuobjdump or nvdisasm)"),
    ):
        p.add_argument(f"--{stage}", action="store_true", help=what)
    add_cache_parser(sub, raw)
    return parser


def _one_line(err: BaseException, limit: int = 600) -> str:
    """An exception as one line: an OSError names its path; a message of several lines (a
    ptxas report) has them joined by " | " and cut at `limit` characters."""
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    text = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
    text = text or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    from ..compiler import CompileError
    from ..targets import ToolchainError

    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    commands = {"warmup": _cmd_warmup, "demo": _cmd_demo, "show": _cmd_show}
    command = commands.get(args.command) or args.run
    name = f"kbuild {args.command}" + (f" {args.action}" if args.command == "cache" else "")
    if extra:  # named by the command they were given to, not by the top-level parser
        parser.exit(2, f"{name}: unrecognized arguments: {' '.join(extra)}\n")
    try:
        return command(args)
    except CLIError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return err.code
    except BrokenPipeError:  # `kbuild cache list | head`: the reader left; end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (ToolchainError, CompileError, OSError) as err:
        print(f"{name}: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
