"""Shared test setup: GPU markers skip cleanly without CUDA; a private compile cache per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA and `multi_gpu` tests with fewer than two devices;
    `rocm` tests without a ROCm torch and an AMD GPU; `not_interpreted` tests under
    KBUILD_INTERPRET (CPU tensors then take the kernels' path)."""
    needs = {}
    interpreted = os.environ.get("KBUILD_INTERPRET", "") not in ("", "0")
    for item in items:
        if interpreted and item.get_closest_marker("not_interpreted"):
            reason = "checks the CPU reference path or the C++ extension, not the kernels"
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        if item.get_closest_marker("rocm"):
            import torch

            if torch.version.hip is None or not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a ROCm torch and an AMD GPU"))
            continue
        if item.get_closest_marker("multi_gpu"):
            needs[item] = 2
        elif item.get_closest_marker("gpu"):
            needs[item] = 1
    if not needs:
        return  # import torch (and probe CUDA) only when some test asks for a GPU
    count = _cuda_device_count()
    for item, wanted in needs.items():
        if count < wanted:
            what = "a CUDA GPU" if wanted == 1 else f"{wanted} or more CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {what}; found {count}"))


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory that KBUILD_CACHE_DIR points at, compiling allowed."""
    root = tmp_path / "kbuild-cache"
    root.mkdir()
    monkeypatch.setenv("KBUILD_CACHE_DIR", str(root))
    monkeypatch.delenv("KBUILD_OFFLINE", raising=False)
    return root


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """os.environ for a child `python` that imports this checkout of kbuild, online (copy it
    before changing it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("KBUILD_OFFLINE", None)
    return env
