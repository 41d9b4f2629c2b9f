"""Cache bundles: export and import between cache directories, and imports of damaged or
hostile archives, which must be refused with the target cache unchanged.

What this catches: a round trip that changes a byte (meta.json rewritten, a new timestamp),
an import that trusts member names (`../` escapes, absolute paths, links), an import that
writes part of a bundle before finding the bad member, a flipped byte or a truncation that
goes unnoticed, and an import that replaces an entry the cache already holds.
"""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from kbuild import cli
from kbuild.artifact import Artifact
from kbuild.cache import DiskCache
from kbuild.cache.bundle import BundleError, export_bundle, import_bundle

E1, E2, T = "a" * 16, "b" * 16, "c" * 16


def _fill(root, arches=("sm_90", "gfx942")) -> DiskCache:
    cache = DiskCache(root)
    for k, arch in enumerate(arches):
        art = Artifact(
            binary=bytes(range(40 + k)) * 3,
            format="cubin" if arch.startswith("sm") else "hsaco",
            entry=f"kern{k}",
            meta={"target": arch, "spec": {"kernel": "rmsnorm_fwd"}},
        )
        cache.put((E1, E2)[k], T, art, {"mlir": "22"})
    return cache


def _files(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


@pytest.mark.parametrize("name", ["warm.tar", "warm.tar.gz"])
def test_round_trip_is_bit_identical(tmp_path, name):
    _fill(tmp_path / "a")
    bundle = str(tmp_path / name)
    assert export_bundle(DiskCache(tmp_path / "a", read_only=True), bundle) == 2
    assert import_bundle(DiskCache(tmp_path / "b"), bundle) == (2, 0)
    assert _files(tmp_path / "b") == _files(tmp_path / "a")
    again = str(tmp_path / ("again-" + name))
    export_bundle(DiskCache(tmp_path / "b", read_only=True), again)
    assert open(again, "rb").read() == open(bundle, "rb").read()  # deterministic
    assert import_bundle(DiskCache(tmp_path / "b"), bundle) == (0, 2)  # present: kept


def test_export_one_arch(tmp_path):
    _fill(tmp_path / "a")
    bundle = str(tmp_path / "sm90.tar")
    assert export_bundle(DiskCache(tmp_path / "a"), bundle, arch="sm_90") == 1
    import_bundle(DiskCache(tmp_path / "b"), bundle)
    assert [m["meta"]["target"] for _, m in DiskCache(tmp_path / "b").entries()] == ["sm_90"]


def _bundle(tmp_path) -> bytes:
    _fill(tmp_path / "src")
    path = tmp_path / "good.tar"
    export_bundle(DiskCache(tmp_path / "src"), str(path))
    return path.read_bytes()


def _refused(tmp_path, data: bytes, match: str):
    target = tmp_path / "target"
    _fill(target, arches=("sm_80",))
    before = _files(target)
    path = tmp_path / "bad.tar"
    path.write_bytes(data)
    with pytest.raises(BundleError, match=match):
        import_bundle(DiskCache(target), str(path))
    assert _files(target) == before  # nothing written, nothing removed


def test_a_flipped_byte_is_refused(tmp_path):
    data = bytearray(_bundle(tmp_path))
    blob = bytes(range(40)) * 3  # the first entry's binary, inside the tar
    at = bytes(data).index(blob) + 7
    data[at] ^= 0x01
    _refused(tmp_path, bytes(data), "does not match its checksum")


def test_a_truncated_bundle_is_refused(tmp_path):
    data = _bundle(tmp_path)
    _refused(tmp_path, data[: len(data) // 2], "truncated|damaged|not a readable|listed but not")


def _with_member(tmp_path, name, kind=tarfile.REGTYPE, payload=b"x"):
    good = _bundle(tmp_path)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(good)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member))
        info = tarfile.TarInfo(name)
        info.type = kind
        if kind == tarfile.SYMTYPE:
            info.linkname = "/etc/passwd"
            dst.addfile(info)
        else:
            info.size = len(payload)
            dst.addfile(info, io.BytesIO(payload))
    return out.getvalue()


@pytest.mark.parametrize(
    "name, kind",
    [
        (f"entries/{E1}/{T}/../../../../evil.txt", tarfile.REGTYPE),
        ("/tmp/evil.txt", tarfile.REGTYPE),
        ("../evil.txt", tarfile.REGTYPE),
        (f"entries/{E1}/{'d' * 16}/kernel.cubin", tarfile.SYMTYPE),
        (f"entries/{E1}/{'d' * 16}/kernel.cubin", tarfile.CHRTYPE),
    ],
)
def test_hostile_members_are_refused(tmp_path, name, kind):
    _refused(
        tmp_path, _with_member(tmp_path, name, kind), "not a bundle entry file|not a regular file"
    )
    assert not (tmp_path / "evil.txt").exists()


def test_an_unlisted_member_is_refused(tmp_path):
    name = f"entries/{'d' * 16}/{T}/kernel.cubin"
    _refused(tmp_path, _with_member(tmp_path, name), "not in its index")


def test_a_meta_that_lies_about_its_binary_is_refused(tmp_path):
    """Checksums of the index match, but meta.json names another binary: refused."""
    import json

    good = _bundle(tmp_path)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(good)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        members = {m.name: src.extractfile(m).read() for m in src}
        meta_name = next(n for n in members if n.endswith("meta.json"))
        meta = json.loads(members[meta_name])
        meta["sha256"] = "0" * 64
        members[meta_name] = json.dumps(meta).encode()
        index = json.loads(members["index.json"])
        for entry in index["entries"]:
            if meta_name.startswith(f"entries/{entry['entry_key']}/{entry['toolchain_key']}"):
                entry["files"]["meta.json"] = hashlib.sha256(members[meta_name]).hexdigest()
        members["index.json"] = json.dumps(index).encode()
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    _refused(tmp_path, out.getvalue(), "not the binary its meta.json names")


def _rewritten(good: bytes, edit) -> bytes:
    """The bundle `good` with each member's bytes replaced by edit(name, data)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(good)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            data = edit(member.name, src.extractfile(member).read())
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_meta_edited_validly_but_not_in_the_index_is_refused(tmp_path):
    """Catches an import that checks meta.json only for describing its binary, not against
    its checksum in the index: a meta.json edited validly (still JSON, still naming its
    binary's size and sha256, another target) with index.json unchanged is taken."""
    import json

    def edit(name, data):
        if not name.endswith("meta.json"):
            return data
        meta = json.loads(data)
        meta["meta"]["target"] = "sm_80"  # the binary is sm_90's (or gfx942's)
        meta["entry"] = "other_kernel"
        return json.dumps(meta, sort_keys=True, indent=1).encode()

    data = _rewritten(_bundle(tmp_path), edit)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # the edit is valid, the index old
        members = {m.name: tar.extractfile(m).read() for m in tar}
    for name, meta_bytes in members.items():
        if name.endswith("meta.json"):
            meta = json.loads(meta_bytes)
            binary = members[name.replace("meta.json", f"kernel.{meta['format']}")]
            assert meta["sha256"] == hashlib.sha256(binary).hexdigest()
            assert meta["size"] == len(binary)
    _refused(tmp_path, data, "meta.json does not match its checksum")


def test_cli_export_import_and_info(tmp_path, capsys):
    _fill(tmp_path / "a")
    bundle = str(tmp_path / "w.tar.gz")
    assert cli.main(["cache", "export", bundle, "--cache-dir", str(tmp_path / "a")]) == 0
    assert cli.main(["cache", "import", bundle, "--cache-dir", str(tmp_path / "b")]) == 0
    assert cli.main(["cache", "info", "--cache-dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "exported 2 entries" in out and "imported 2 entries" in out
    assert "2 entries" in out and "gfx942 1" in out and "sm_90 1" in out
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all")
    junk = ["cache", "import", str(tmp_path / "junk.tar"), "--cache-dir", str(tmp_path / "b")]
    assert cli.main(junk) == 1
    assert "refused" in capsys.readouterr().err
