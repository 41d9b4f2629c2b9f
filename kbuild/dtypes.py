"""Element types kbuild kernels read and write, by their MLIR names. Pure Python (no MLIR)."""

ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1, "i32": 4, "i64": 8}
FLOAT_DTYPES = ("f32", "f16", "bf16")
