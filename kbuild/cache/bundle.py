"""Cache bundles: one archive of cache entries, to ship a warmed cache to machines with no
compiler, and its import, which treats the archive as untrusted input.

A bundle is a tar file (gzip-compressed when its name ends in .gz / .tgz):

    index.json                                   {"bundle": 1, "kbuild": ..., "entries": [...]}
    entries/<entry_key>/<toolchain_key>/meta.json
    entries/<entry_key>/<toolchain_key>/kernel.<format>

The index lists every entry with the sha256 of each of its files and the toolchain that
built it. Import reads the whole archive and verifies everything before anything becomes
visible: member names must be exactly of the form above (no absolute paths, no `..`, no
other names), members must be regular files (no links, devices or directories with content),
every file must match its checksum in the index, every meta.json must describe its binary
(size and sha256). Then each entry is written the way the cache writes its own (binary, then
meta.json, each renamed into place), so processes reading the cache meanwhile see whole
entries or none; an entry the cache already holds intact is left as it is. No pickle, no
extraction to paths the archive chooses.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile

from .disk import DiskCache, _valid_meta

BUNDLE_VERSION = 1
INDEX = "index.json"
_MEMBER = re.compile(
    r"entries/([0-9a-f]{8,64})/([0-9a-f]{8,64})/(meta\.json|kernel\.[a-z0-9]{1,16})"
)
MAX_MEMBER_BYTES = 256 << 20  # a kernel binary is kilobytes; this only bounds a hostile archive


class BundleError(ValueError):
    """The archive is not a bundle kbuild will import; the message says why."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mode(path: str) -> str:
    return "r:gz" if path.endswith((".gz", ".tgz")) else "r:"


def export_bundle(cache: DiskCache, path: str, arch: str | None = None) -> int:
    """Write every intact entry of `cache` (for `arch` only, if given) to the bundle `path`;
    returns how many. Members carry no owner, mode bits 0644 and the entries' own times, so
    one cache exports to the same bytes every time."""
    from ..version import __version__

    index = {"bundle": BUNDLE_VERSION, "kbuild": __version__, "entries": []}
    members: list[tuple[str, bytes, float]] = []
    for directory, meta in cache.entries():
        if arch is not None and meta["meta"].get("target") != arch:
            continue
        binary_name = f"kernel.{meta['format']}"
        try:
            binary = (directory / binary_name).read_bytes()
            meta_bytes = (directory / "meta.json").read_bytes()
        except OSError:
            continue
        if len(binary) != meta["size"] or _sha(binary) != meta["sha256"]:
            continue  # damaged: not shipped
        toolchain_key, entry_key = directory.name, directory.parent.name
        base = f"entries/{entry_key}/{toolchain_key}"
        index["entries"].append(
            {
                "entry_key": entry_key,
                "toolchain_key": toolchain_key,
                "target": meta["meta"].get("target"),
                "toolchain": meta["toolchain"],
                "files": {"meta.json": _sha(meta_bytes), binary_name: _sha(binary)},
            }
        )
        stamp = float(meta["written_at"])
        members += [
            (f"{base}/meta.json", meta_bytes, stamp),
            (f"{base}/{binary_name}", binary, stamp),
        ]
    index_bytes = json.dumps(index, sort_keys=True, indent=1).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, stamp in [(INDEX, index_bytes, 0.0), *members]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(stamp), 0o644
            tar.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    if path.endswith((".gz", ".tgz")):  # no file name or time in the header: same bytes
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)
    return len(index["entries"])


def _read_members(path: str) -> dict[str, bytes]:
    try:
        tar = tarfile.open(path, _mode(path))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise BundleError(f"{path} is not a readable bundle: {err}") from None
    files: dict[str, bytes] = {}
    with tar:
        try:
            for member in tar:
                name = member.name
                if name != INDEX and not _MEMBER.fullmatch(name):
                    raise BundleError(f"{path}: member {name!r} is not a bundle entry file")
                if not member.isreg():
                    raise BundleError(f"{path}: member {name!r} is not a regular file")
                if member.size > MAX_MEMBER_BYTES:
                    raise BundleError(f"{path}: member {name!r} is {member.size} bytes")
                if name in files:
                    raise BundleError(f"{path}: member {name!r} appears twice")
                data = tar.extractfile(member).read()
                if len(data) != member.size:
                    raise BundleError(f"{path}: member {name!r} is truncated")
                files[name] = data
        except (tarfile.TarError, OSError, EOFError) as err:
            raise BundleError(f"{path} is damaged: {err}") from None
    if INDEX not in files:
        raise BundleError(f"{path} has no {INDEX}")
    return files


def import_bundle(cache: DiskCache, path: str) -> tuple[int, int]:
    """Verify the bundle `path` whole, then add its entries to `cache`; (added, already
    present). Raises BundleError, with the cache unchanged, if anything does not verify."""
    files = _read_members(path)
    try:
        index = json.loads(files.pop(INDEX))
        entries = index["entries"]
        if index.get("bundle") != BUNDLE_VERSION or not isinstance(entries, list):
            raise ValueError("unknown bundle version")
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path}: its index is not a bundle index ({err})") from None
    verified = []
    listed = set()
    for entry in entries:
        try:
            entry_key, toolchain_key = entry["entry_key"], entry["toolchain_key"]
            sums = dict(entry["files"])
        except (KeyError, TypeError) as err:
            raise BundleError(f"{path}: an index entry is malformed ({err})") from None
        base = f"entries/{entry_key}/{toolchain_key}"
        found = {}
        for name, digest in sums.items():
            member = f"{base}/{name}"
            if member not in files or not _MEMBER.fullmatch(member):
                raise BundleError(f"{path}: {member} is listed but not in the archive")
            if _sha(files[member]) != digest:
                raise BundleError(f"{path}: {member} does not match its checksum")
            found[name] = files[member]
            listed.add(member)
        meta = _parse_meta(found.get("meta.json"))
        binary_name = f"kernel.{meta['format']}" if meta else None
        if meta is None or binary_name not in found:
            raise BundleError(f"{path}: {base} has no valid meta.json and binary")
        binary = found[binary_name]
        if len(binary) != meta["size"] or _sha(binary) != meta["sha256"]:
            raise BundleError(f"{path}: {base}/{binary_name} is not the binary its meta.json names")
        verified.append((entry_key, toolchain_key, binary_name, binary, found["meta.json"]))
    unlisted = set(files) - listed
    if unlisted:
        raise BundleError(f"{path}: members not in its index: {sorted(unlisted)[:3]}")
    added = present = 0
    for entry_key, toolchain_key, binary_name, binary, meta_bytes in verified:
        if cache.get(entry_key, toolchain_key) is not None:
            present += 1  # a good entry stays as it is
            continue
        cache.put_files(entry_key, toolchain_key, binary_name, binary, meta_bytes)
        added += 1
    return added, present


def _parse_meta(data: bytes | None) -> dict | None:
    """meta.json bytes checked by the rules the cache reads its own by."""
    if data is None:
        return None
    try:
        meta = json.loads(data)
    except ValueError:
        return None
    return meta if _valid_meta(meta) else None
