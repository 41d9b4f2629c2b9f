"""kbuild's kernels, one package per op family, each holding its kernels' declarations and
builders and its ops: norms/, loss/, softmax/, rope/, activations/, llmc/; reduce.py holds the
fixed-order column sums every parameter gradient ends with, and resolve.py the C++ hot path's
one call into Python. The registry of every kernel by name, and the `kernel` decorator that
declares one beside its builder, are kbuild/registry.py's.

Declaring imports no MLIR: builders import it when they run, and a machine that only runs
kernels from a warmed cache has none.
"""
