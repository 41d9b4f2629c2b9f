"""KernelSpec: the name of a kernel builder plus every compile-time parameter it takes.

A spec is what the cache keys on and what warmup manifests list. It is plain data (str, int,
float, bool, None) so it serialises to JSON without pickle, and it is hashable so the
in-memory tier can use it directly as a dict key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

Scalar = str | int | float | bool | None


def _canonical(value: Any) -> Any:
    """The JSON form of one parameter; floats by their exact bits so 1e-5 != 1.0000001e-5."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"kernel parameters must be finite, got {value!r}")
        return {"float": value.hex()}
    raise TypeError(f"kernel parameters must be str, int, float, bool or None, got {value!r}")


@dataclass(frozen=True)
class KernelSpec:
    """`kernel` names a kernel of kbuild.kernels.KERNELS; `params` are its builder's keyword
    arguments."""

    kernel: str
    params: tuple[tuple[str, Scalar], ...]

    @classmethod
    def make(cls, kernel: str, **params: Scalar) -> KernelSpec:
        for value in params.values():
            _canonical(value)
        return cls(kernel, tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Scalar:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)

    @property
    def kwargs(self) -> dict[str, Scalar]:
        return dict(self.params)

    def canonical_json(self) -> str:
        """A stable text form: the cache key hashes it, manifests print it."""
        body = {k: _canonical(v) for k, v in self.params}
        return json.dumps({"kernel": self.kernel, "params": body}, sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "params": {k: _canonical(v) for k, v in self.params}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelSpec:
        params = {}
        for key, value in data["params"].items():
            params[key] = float.fromhex(value["float"]) if isinstance(value, dict) else value
        return cls.make(data["kernel"], **params)

    def short(self) -> str:
        """A one-line human label, e.g. `rmsnorm_fwd(N=4096, dtype=bf16, ...)`."""
        args = ", ".join(
            f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params
        )
        return f"{self.kernel}({args})"
