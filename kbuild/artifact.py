"""Artifact: one compiled kernel as bytes plus JSON-able metadata (no pickle anywhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Artifact:
    """A loadable GPU binary.

    `format` is "cubin" or "ptx" (NVIDIA) or "hsaco" (AMD); `entry` is the kernel symbol;
    `meta` holds the launch facts the runtime needs (block size, shared memory bytes) and the
    facts people want to see (registers, spills, compile milliseconds, the spec, the target).
    """

    binary: bytes
    format: str
    entry: str
    meta: dict[str, Any] = field(default_factory=dict)
