"""`kbuild cache ...`: list, path, clear, info, export, import and prune the disk cache, one
subcommand each with its own options and help."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..cache import DiskCache
from ..spec import KernelSpec
from .args import CACHE_DIR_HELP, CLIError, Parser, cache_root, check_arch, plural


def _cache_list(args) -> int:
    """One line per entry on stdout (nothing else there, for scripts); an empty cache is
    said on stderr and is no error: it lists what there is."""
    root = cache_root(args, must_exist=True)
    listed = 0
    for path, meta in DiskCache(root).entries():
        spec = meta["meta"].get("spec")
        label = KernelSpec.from_json(spec).short() if spec else "(no spec recorded)"
        print(f"{meta['meta'].get('target', '?'):7} {meta['format']:5} {label}  {path}")
        listed += 1
    if not listed:
        print(f"kbuild cache list: no entries in {root}", file=sys.stderr)
    return 0


def _cache_path(args) -> int:
    print(cache_root(args))
    return 0


def _cache_clear(args) -> int:
    root = cache_root(args)
    if not Path(root).exists():
        print(f"no cache at {root}: nothing to clear")
        return 0
    DiskCache(root).clear()
    print(f"cleared {root}")
    return 0


def _cache_info(args) -> int:
    """Entries and bytes, per arch and kernel family, and the toolchains present."""
    from collections import Counter

    from ..cache.keys import toolchain_key as key_of
    from ..cache.prune import is_stale, scan

    cache = DiskCache(cache_root(args, must_exist=True))
    entries = scan(cache)  # prune's view: each entry's size and meta, read once
    size, stale = sum(e.size for e in entries), sum(map(is_stale, entries))
    by_arch, by_kernel, toolchains = Counter(), Counter(), Counter()
    for e in entries:
        meta = e.meta
        by_arch[meta["meta"].get("target", "?")] += 1
        by_kernel[meta["meta"].get("spec", {}).get("kernel", "?")] += 1
        toolchains[(key_of(meta["toolchain"]), json.dumps(meta["toolchain"], sort_keys=True))] += 1
    count = plural(len(entries), "entry", "entries")
    print(f"{cache.root}: {count}, {size / 1e6:.1f} MB, {stale} stale")
    for title, counts in (("arch", by_arch), ("kernel", by_kernel)):
        print(f"  by {title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for (key, tools), count in sorted(toolchains.items()):
        print(f"  toolchain {key}: {plural(count, 'entry', 'entries')}  {tools}")
    return 0


# What export_bundle writes: a tar, gzip-compressed for .tar.gz and .tgz (cache/bundle.py).
BUNDLE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _cache_export(args) -> int:
    from ..cache.bundle import export_bundle

    if not args.file.endswith(BUNDLE_SUFFIXES):
        raise CLIError(
            f"FILE {args.file}: a bundle's name ends in .tar, .tar.gz or .tgz (the tar, or "
            "gzipped tar, that export writes)"
        )
    if args.arch is not None:
        check_arch(args.arch)
    root = cache_root(args, must_exist=True)
    folder = Path(args.file).expanduser().resolve().parent
    if not folder.is_dir():
        raise CLIError(f"FILE: the folder {folder} does not exist")
    cache = DiskCache(root, read_only=True)
    if not any(args.arch in (None, meta["meta"].get("target")) for _, meta in cache.entries()):
        which = f" for {args.arch}" if args.arch else ""
        raise CLIError(f"no entries{which} in {root}: nothing exported", 1)
    count = export_bundle(cache, args.file, args.arch)
    print(f"exported {plural(count, 'entry', 'entries')} from {root} to {args.file}")
    return 0


def _cache_import(args) -> int:
    from ..cache.bundle import BundleError, import_bundle

    root = cache_root(args)
    try:
        added, present = import_bundle(DiskCache(root), args.file)
    except (BundleError, OSError) as err:
        raise CLIError(f"refused {args.file}: {err}", 1) from None
    print(f"imported {plural(added, 'entry', 'entries')} into {root} ({present} already there)")
    return 0


def _cache_prune(args) -> int:
    from ..cache.prune import parse_age, parse_size, prune

    if args.max_size is None and args.older_than is None and not args.stale:
        raise CLIError("give --max-size, --older-than or --stale")
    try:
        size = None if args.max_size is None else parse_size(args.max_size)
        age = None if args.older_than is None else parse_age(args.older_than)
    except ValueError as err:
        raise CLIError(str(err)) from None
    root = cache_root(args, must_exist=True)
    removed = prune(DiskCache(root), size, age, args.stale)
    freed = sum(e.size for e in removed)
    print(f"removed {plural(len(removed), 'entry', 'entries')} ({freed / 1e6:.1f} MB) from {root}")
    return 0


def add_cache_parser(sub, raw) -> None:
    p = sub.add_parser(
        "cache",
        help="inspect, clear, export or import the disk cache",
        epilog="examples:\n  kbuild cache info\n  kbuild cache export warm.tar.gz --arch sm_90\n"
        "  kbuild cache import warm.tar.gz --cache-dir DIR\n"
        "  kbuild cache prune --max-size 2G --older-than 30d --stale",
        formatter_class=raw,
    )
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    common = Parser(add_help=False)
    common.add_argument("--cache-dir", help=CACHE_DIR_HELP)
    for name, run, helptext, example in (
        ("list", _cache_list, "one line per entry: arch, format, kernel, folder", "list"),
        ("path", _cache_path, "print the cache folder", "path"),
        ("clear", _cache_clear, "remove every entry (nothing else in the folder)", "clear"),
        ("info", _cache_info, "entries and bytes per arch, kernel and toolchain", "info"),
        ("export", _cache_export, "write the entries to one archive", "export warm.tar.gz"),
        ("import", _cache_import, "add an archive's entries, verified", "import warm.tar.gz"),
        (
            "prune",
            _cache_prune,
            "remove stale, old or least recently used entries",
            "prune --max-size 2G --older-than 30d --stale",
        ),
    ):
        q = actions.add_parser(
            name,
            parents=[common],
            help=helptext,
            description=helptext,
            epilog=f"example:\n  kbuild cache {example}",
            formatter_class=raw,
        )
        q.set_defaults(run=run)
        if name in ("export", "import"):
            q.add_argument("file", metavar="FILE", help="the bundle (.tar, .tar.gz or .tgz)")
        if name == "export":
            q.add_argument("--arch", help="export only the entries for this arch")
        if name == "prune":
            q.add_argument("--max-size", help="least recently used first, down to e.g. 2G")
            q.add_argument("--older-than", help="entries not used for e.g. 30d")
            q.add_argument("--stale", action="store_true", help="entries of other kbuild sources")
