"""What `kbuild.nn.patching.patch` changed in a model, what it left stock and why, and how to undo
it: `PatchReport`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("norm", "mlp", "rope", "loss")
NOTHING = (
    "nothing kbuild patches: no norm module, gated or GPT-2 MLP, attention calling "
    "apply_rotary_pos_emb, or CausalLM with an lm_head in this model"
)


@dataclass(frozen=True)
class Swap:
    """One module patched. `path`: its dotted name in the model ("" for the model itself);
    `kind`: one of KINDS; `what`: the kbuild op or module it now runs (e.g. "swiglu",
    "RMSNorm(offset=1.0)"); `level`: "instance" (this module object only) or "module" (a
    function of a modeling module, so every model of that family in the process)."""

    path: str
    kind: str
    what: str
    level: str = "instance"


@dataclass(frozen=True)
class Kept:
    """One candidate left stock, and why."""

    path: str
    kind: str
    reason: str


@dataclass
class PatchReport:
    """The outcome of `patch(model)`: `swaps` (Swap, in the order made) and `kept` (Kept).
    `unpatch()` puts every patched module back as it was, in reverse order."""

    model: str = ""
    swaps: list[Swap] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def add(self, swap: Swap, undo: Callable[[], None]) -> None:
        self.swaps.append(swap)
        self._undo.append(undo)

    def keep(self, path: str, kind: str, reason: str) -> None:
        self.kept.append(Kept(path, kind, reason))

    def paths(self, kind: str | None = None) -> list[str]:
        """Dotted names of the patched modules, of one kind or all."""
        return [s.path for s in self.swaps if kind is None or s.kind == kind]

    def unpatch(self) -> None:
        """Restore every patched module (forwards, submodules, norm modules) to what it was
        before `patch`. Idempotent: a second call does nothing."""
        while self._undo:
            self._undo.pop()()
        self.kept.extend(Kept(s.path, s.kind, "unpatched") for s in self.swaps)
        self.swaps.clear()

    def __bool__(self) -> bool:
        return bool(self.swaps)

    def __str__(self) -> str:
        head = (
            f"kbuild.nn.patch({self.model}): {len(self.swaps)} patched, {len(self.kept)} left stock"
        )
        lines = [head]
        if not self.swaps and not self.kept:
            lines.append(f"  {NOTHING}")
        groups: dict[tuple[str, str, str], list[str]] = {}
        for s in self.swaps:
            groups.setdefault((s.kind, s.what, s.level), []).append(s.path)
        for (kind, what, level), paths in sorted(groups.items(), key=lambda g: _order(g[0][0])):
            scope = "" if level == "instance" else f"  [{level}-level: every model of the family]"
            lines.append(f"  {kind:<5} {what:<32} {len(paths):>3}  {_collapse(paths)}{scope}")
        reasons: dict[tuple[str, str], list[str]] = {}
        for k in self.kept:
            reasons.setdefault((k.kind, k.reason), []).append(k.path)
        if reasons:
            lines.append("  left stock:")
        for (kind, reason), paths in sorted(reasons.items(), key=lambda g: _order(g[0][0])):
            lines.append(f"  {kind:<5} {_collapse(paths)}: {reason}")
        return "\n".join(lines)


def _order(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def _collapse(paths: list[str]) -> str:
    """'model.layers.{0..31}.mlp' for the 32 paths that differ only in one layer index."""
    groups: dict[str, list[int] | None] = {}  # in order of first appearance
    for p in paths:
        m = re.search(r"\.(\d+)\.", f".{p}.")
        if m is None:
            groups[p or "(model)"] = None
            continue
        key = (f".{p}."[: m.start()] + ".{}." + f".{p}."[m.end() :]).strip(".")
        groups.setdefault(key, []).append(int(m.group(1)))
    out = []
    for key, idx in groups.items():
        if idx is None:
            out.append(key)
            continue
        idx = sorted(set(idx))
        if len(idx) == 1:
            text = str(idx[0])
        elif idx == list(range(idx[0], idx[-1] + 1)):
            text = f"{{{idx[0]}..{idx[-1]}}}"
        else:
            text = "{" + ",".join(map(str, idx)) + "}"
        out.append(key.replace("{}", text, 1))
    return ", ".join(out)
