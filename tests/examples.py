"""The worked example (examples/custom_softmax.py) as the tests import it: by its own module
name, so its ops are declared once per process however many test modules use it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_softmax.py"


def import_example(keep_kernels: bool = True):
    """The example module, its kernels in kbuild's registry (registered again where an
    earlier test dropped them: the cache finds a kernel's builder there, a GPU test needs
    them). `keep_kernels=False` drops them at once instead (later test modules, the
    fingerprint tests, read kbuild's own kernels only)."""
    from kbuild.registry import KERNELS, register

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        module = importlib.import_module(EXAMPLE.stem)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    for definition in (module.build_softmax_fwd, module.build_softmax_bwd):
        if keep_kernels:
            register(definition)
        else:
            KERNELS.pop(definition.name, None)
    return module
