"""`kbuild` command line: warmup (ahead-of-time compile), demo (the main job), cache.

kbuild warmup --arch sm_90 --manifest tests --cache-dir .kbuild-aot
kbuild warmup --arch gfx942 --hidden 4096 --dtype bf16     # every kernel of a model width
kbuild warmup --hidden 2048 --head-dim 128                  # ... with a QK-norm (Qwen3)
kbuild warmup --arch sm_90 --from run.jsonl                 # what KBUILD_RECORD=run.jsonl saw
kbuild demo                       # compile the standard set; with a GPU also run and time it
kbuild cache list | path | clear | info | export FILE | import FILE | prune --max-size 2G

Errors go to stderr with a non-zero status; output piped into `head` ends quietly.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from .cache import DiskCache, default_cache_dir
from .manifest import DEFAULT_WIDTH_OPS, MANIFESTS, WIDTH_OPS, manifest
from .spec import KernelSpec
from .targets import target_for_arch


def _warm_one(spec_json: str, arch: str, root: str) -> tuple[str, dict, bool, float]:
    """Compile one spec into the cache (a worker process); returns its label and metadata."""
    from .jit import build_into

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


def warmup(specs: list[KernelSpec], arch: str, root: str, jobs: int) -> list[tuple]:
    """Compile `specs` for `arch` into `root`, printing a progress line per kernel."""
    os.makedirs(root, exist_ok=True)
    results = []
    args = [(s.canonical_json(), arch, root) for s in specs]
    width = len(str(len(specs)))

    def report(i: int, result: tuple) -> None:
        print(f"[{i:>{width}}/{len(specs)}] {arch}  {_describe(*result)}", flush=True)
        results.append(result)

    if jobs <= 1:  # in this process: nothing outlives it if it is killed
        for i, arg in enumerate(args, 1):
            report(i, _warm_one(*arg))
        return results
    # forkserver, not fork: a caller may have threads (torch's, a test runner's), and a
    # forked child can block forever on a lock one of them held at the fork.
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for i, result in enumerate(pool.map(_warm_one, *zip(*args, strict=True)), 1):
            report(i, result)
    return results


def _specs_from(args) -> list[KernelSpec]:
    from .manifest import for_width
    from .record import read_specs

    specs = [s for name in args.manifest or [] for s in manifest(name)]
    for path in args.from_file or []:
        try:
            specs += read_specs(path)
        except (OSError, ValueError) as err:
            raise SystemExit(f"kbuild warmup: --from {path}: {err}") from None
    if args.head_dim is not None and args.hidden is None:
        raise SystemExit("kbuild warmup: --head-dim goes with --hidden (the model's width)")
    if args.hidden is not None:
        ops = tuple(filter(None, args.ops.split(",")))
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
            raise SystemExit(f"kbuild warmup: --hidden: {err}") from None
    for text in args.spec or []:
        try:
            specs.append(KernelSpec.from_json(json.loads(text)))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise SystemExit(
                f"kbuild warmup: --spec is not a kernel spec ({err}): {text}"
            ) from None
    return list(dict.fromkeys(specs))


def _check_arch(arch: str) -> None:
    try:
        target = target_for_arch(arch)
    except ValueError as err:
        raise SystemExit(f"kbuild: --arch: {err}") from None
    if target.vendor == "amd":
        import importlib.util

        if importlib.util.find_spec("llvmlite") is None:
            raise SystemExit(
                f"kbuild: --arch {arch}: AMD code objects need the amd extra "
                "(pip install 'kbuild[amd]': llvmlite and an ld.lld)"
            )


def _cmd_warmup(args) -> int:
    _check_arch(args.arch)
    specs = _specs_from(args)
    if not specs:
        print(
            "nothing to warm: give --manifest NAME, --spec JSON, --from FILE or --hidden N",
            file=sys.stderr,
        )
        return 2
    root = args.cache_dir or str(default_cache_dir())
    start = time.perf_counter()
    warmup(specs, args.arch, root, args.jobs)
    print(f"{len(specs)} kernels for {args.arch} in {root} ({time.perf_counter() - start:.1f} s)")
    return 0


def _cmd_show(args) -> int:
    from .compiler import CompileError
    from .show import STAGES, parse_spec, stages

    _check_arch(args.arch)
    wanted = tuple(s for s in STAGES if getattr(args, s)) or ("ptx",)
    try:
        spec = parse_spec(args.spec)
        texts = stages(spec, args.arch, wanted)
    except (ValueError, TypeError, CompileError) as err:
        print(f"kbuild show: {err}", file=sys.stderr)
        return 1
    for stage in wanted:
        if len(wanted) > 1:
            print(f"// ---- {stage} ({spec.short()}, {args.arch})")
        print(texts[stage])
    return 0


def _cache_info(cache: DiskCache) -> int:
    """Entries and bytes, per arch and kernel family, and the toolchains present."""
    from collections import Counter

    from .cache.keys import toolchain_key as key_of
    from .cache.prune import is_stale, scan

    entries = scan(cache)  # prune's view: each entry's size and meta, read once
    size, stale = sum(e.size for e in entries), sum(map(is_stale, entries))
    by_arch, by_kernel, toolchains = Counter(), Counter(), Counter()
    for e in entries:
        meta = e.meta
        by_arch[meta["meta"].get("target", "?")] += 1
        by_kernel[meta["meta"].get("spec", {}).get("kernel", "?")] += 1
        toolchains[(key_of(meta["toolchain"]), json.dumps(meta["toolchain"], sort_keys=True))] += 1
    print(f"{cache.root}: {len(entries)} entries, {size / 1e6:.1f} MB, {stale} stale")
    for title, counts in (("arch", by_arch), ("kernel", by_kernel)):
        print(f"  by {title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for (key, tools), count in sorted(toolchains.items()):
        print(f"  toolchain {key}: {count} entries  {tools}")
    return 0


def _cmd_demo(args) -> int:
    _check_arch(args.arch)
    root = args.cache_dir or str(default_cache_dir())
    print(f"kbuild demo: the standard kernel set for {args.arch}, cache {root}")
    from . import env

    if env.compiler_available():
        warmup(manifest("standard"), args.arch, root, args.jobs)
    else:
        print("MLIR is not installed here: running from the cache as it is")
    from .demo import run_on_gpu

    return run_on_gpu(root)


def _cmd_cache(args) -> int:
    root = args.cache_dir or str(default_cache_dir())
    cache = DiskCache(root)
    if args.action in ("export", "import"):
        from .cache.bundle import BundleError, export_bundle, import_bundle

        if not args.file:
            print(f"kbuild cache {args.action}: give the bundle FILE", file=sys.stderr)
            return 2
        if args.action == "export":
            count = export_bundle(DiskCache(root, read_only=True), args.file, args.arch)
            print(f"exported {count} entries from {root} to {args.file}")
            return 0
        try:
            added, present = import_bundle(cache, args.file)
        except (BundleError, OSError) as err:
            print(f"kbuild cache import: refused: {err}", file=sys.stderr)
            return 1
        print(f"imported {added} entries into {root} ({present} already there)")
        return 0
    if args.action == "info":
        return _cache_info(cache)
    if args.action == "prune":
        from .cache.prune import parse_age, parse_size, prune

        if args.max_size is None and args.older_than is None and not args.stale:
            print("kbuild cache prune: give --max-size, --older-than or --stale", file=sys.stderr)
            return 2
        try:
            size = None if args.max_size is None else parse_size(args.max_size)
            age = None if args.older_than is None else parse_age(args.older_than)
        except ValueError as err:
            print(f"kbuild cache prune: {err}", file=sys.stderr)
            return 2
        removed = prune(cache, size, age, args.stale)
        freed = sum(e.size for e in removed)
        print(f"removed {len(removed)} entries ({freed / 1e6:.1f} MB) from {root}")
        return 0
    if args.action == "path":
        print(root)
    elif args.action == "clear":
        cache.clear()
        print(f"cleared {root}")
    else:
        for path, meta in cache.entries():
            spec = meta["meta"].get("spec")
            label = KernelSpec.from_json(spec).short() if spec else "(no spec recorded)"
            print(f"{meta['meta'].get('target', '?'):7} {meta['format']:5} {label}  {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kbuild", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("warmup", "compile kernels into the disk cache (no GPU needed)"),
        ("demo", "compile the standard kernels and, with a GPU, check and time them"),
    ):
        examples = {
            "warmup": "examples:\n  kbuild warmup --arch sm_90 --manifest tests --cache-dir DIR\n"
            "  kbuild warmup --arch gfx942 --hidden 4096 --dtype bf16 --weight-dtype f32\n"
            "  KBUILD_RECORD=run.jsonl python train.py; kbuild warmup --from run.jsonl",
            "demo": "example:\n  kbuild demo --arch sm_90 --cache-dir DIR",
        }
        p = sub.add_parser(
            name,
            help=helptext,
            epilog=examples[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--arch", default="sm_90", help="target arch (default sm_90)")
        p.add_argument("--cache-dir", help="cache root (default $KBUILD_CACHE_DIR or ~/.cache)")
        p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
        if name == "warmup":
            p.add_argument("--manifest", action="append", choices=sorted(MANIFESTS))
            p.add_argument("--spec", action="append", help="a spec as JSON (see warmup hints)")
            p.add_argument(
                "--from",
                dest="from_file",
                action="append",
                metavar="FILE",
                help="specs recorded with KBUILD_RECORD=FILE (JSON lines)",
            )
            p.add_argument("--hidden", type=int, help="every kernel of a model of this width")
            p.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
            p.add_argument("--weight-dtype", choices=("bf16", "f16", "f32"))
            p.add_argument(
                "--ops",
                default=",".join(DEFAULT_WIDTH_OPS),
                help=f"comma-separated, among {', '.join(WIDTH_OPS)} (encoder: GPT-2's "
                "embedding; linear: a GPT-2 block's bias gradients)",
            )
            p.add_argument("--residual-fp32", action="store_true")
            p.add_argument(
                "--rms-offset",
                type=float,
                default=0.0,
                help="RMSNorm's weight offset (Gemma: 1.0) for --hidden",
            )
            p.add_argument(
                "--head-dim",
                type=int,
                help="with --hidden: a QK-norm over heads of this width (Qwen3: 128)",
            )
    p = sub.add_parser(
        "show",
        help="print what a kernel became: MLIR, LLVM, PTX or AMDGPU asm, SASS",
        epilog="examples:\n  kbuild show 'rmsnorm_fwd(N=4096, dtype=bf16, eps=1e-06, "
        "store_rstd=True, vectorize=True, weight_dtype=bf16)' --ptx\n"
        '  kbuild show \'{"kernel": "column_sum", "params": {"N": 1024, '
        '"out_dtype": "bf16"}}\' --asm --arch gfx942',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", help="a spec as JSON, or the label warmup prints")
    p.add_argument("--arch", default="sm_90")
    for stage in ("mlir", "llvm", "ptx", "asm", "sass"):
        p.add_argument(f"--{stage}", action="store_true")
    p = sub.add_parser(
        "cache",
        help="inspect, clear, export or import the disk cache",
        epilog="examples:\n  kbuild cache info\n  kbuild cache export warm.tar.gz --arch sm_90\n"
        "  kbuild cache import warm.tar.gz --cache-dir DIR\n"
        "  kbuild cache prune --max-size 2G --older-than 30d --stale",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=("list", "path", "clear", "info", "export", "import", "prune"))
    p.add_argument("file", nargs="?", help="the bundle (export, import)")
    p.add_argument("--arch", help="export only entries for this arch")
    p.add_argument("--max-size", help="prune: least recently used first, down to e.g. 2G")
    p.add_argument("--older-than", help="prune: entries not used for e.g. 30d")
    p.add_argument("--stale", action="store_true", help="prune: entries of other kbuild sources")
    p.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    commands = {"warmup": _cmd_warmup, "demo": _cmd_demo, "cache": _cmd_cache, "show": _cmd_show}
    command = commands[args.command]
    try:
        return command(args)
    except BrokenPipeError:  # `kbuild cache list | head`: the reader left; end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
