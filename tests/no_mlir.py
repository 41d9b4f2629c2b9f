"""A child Python's first lines that hide MLIR, as the GPU machine (which runs kernels from a
warmed cache) lacks it: a finder first on sys.meta_path refuses `mlir` on every import route,
`import`, importlib.import_module (pytest.importorskip since pytest 9.1) and __import__
alike. Replacing builtins.__import__ instead misses the second route."""

HIDE_MLIR = (
    "import sys\n"
    "class NoMLIR:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'mlir': raise ModuleNotFoundError(name, name=name)\n"
    "sys.meta_path.insert(0, NoMLIR())\n"
)
