"""A user's builder is re-keyed when a helper module it imports changes, whichever way it
imports it (kbuild/cache/sources.py: the builder's own file and what it imports, found by
reading its imports): `from pkg import helper` names a module as if it were a name in the
package, `from . import helper` has no module at all (node.module is None), and both are
easy to read as "pkg's __init__" only. Each case is a fresh package on sys.path: the
fingerprint must change when the helper (or what the helper imports) changes, and not when a
module the builder does not import changes."""

from __future__ import annotations

import importlib
import itertools
import sys

import pytest

from kbuild.cache.sources import builder_files, fingerprint

# How the builder (pkg/builder.py, or pkg/sub/builder.py) reaches pkg/helper.py.
FORMS = {
    "from pkg import helper": ("builder.py", "from {pkg} import helper"),
    "from . import helper": ("builder.py", "from . import helper"),
    "from .helper import name": ("builder.py", "from .helper import SCALE"),
    "from pkg.helper import name": ("builder.py", "from {pkg}.helper import SCALE"),
    "import pkg.helper": ("builder.py", "import {pkg}.helper"),
    "from .. import helper (subpackage)": ("sub/builder.py", "from .. import helper"),
    "from pkg import helper (subpackage)": ("sub/builder.py", "from {pkg} import helper"),
    "from . import helper, in the function": ("builder.py", None),
}
_names = itertools.count()


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package (a new name each time: sys.modules keeps the ones imported before)
    with a helper, what the helper imports, and a module nobody imports."""
    name = f"kbuild_user_pkg_{next(_names)}"
    root = tmp_path / "src"
    pkg = root / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("from . import consts\n\nSCALE = consts.BASE * 2\n")
    (pkg / "consts.py").write_text("BASE = 1.5\n")
    (pkg / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(root))
    yield name, pkg
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    importlib.invalidate_caches()


def _write_builder(pkg, name: str, form: str) -> str:
    where, line = FORMS[form]
    if line is None:  # the import inside the builder, as kbuild's builders import the DSL
        body = "def build(N, target):\n    from . import helper\n\n    return helper.SCALE * N\n"
    else:
        body = f"{line.format(pkg=name)}\n\n\ndef build(N, target):\n    return N\n"
    (pkg / where).write_text(body)
    module = where.removesuffix(".py").replace("/", ".")
    return f"{name}.{module}:build"


@pytest.mark.parametrize("form", FORMS)
def test_a_helper_edit_rekeys_the_builder(package, form):
    """Catches an import form the walk does not follow: the helper's edit would leave the
    key as it was, and the cache would serve the binary built from the old helper."""
    name, pkg = package
    builder = _write_builder(pkg, name, form)
    labels = {label for label, _ in builder_files(builder)}
    assert any(label.endswith("helper.py") for label in labels), labels
    before = fingerprint(builder)
    (pkg / "unrelated.py").write_text("X = 2\n")
    assert fingerprint(builder) == before  # not every file of the package
    (pkg / "helper.py").write_text("from . import consts\n\nSCALE = consts.BASE * 3\n")
    edited = fingerprint(builder)
    assert edited != before
    (pkg / "consts.py").write_text("BASE = 2.5\n")  # what the helper imports, in turn
    assert fingerprint(builder) != edited
