"""What the command line's commands share: its error, argument types and checks, and the
cache folder a command works on."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..cache import default_cache_dir
from ..targets import target_for_arch


class CLIError(Exception):
    """What the user asked cannot be done; main prints it as one line with `code` as the exit
    status (2: the arguments are wrong, 1: they are right and the work failed)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 kernel", "2 kernels"; `nouns` where the plural is not noun + "s"."""
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def positive_int(text: str) -> int:
    """argparse type: an int from 1 to 2^63 - 1 (a width, a job count: kernel parameters and
    tensor sizes are 64-bit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"expected an integer below 2^63, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite float (a kernel's compile-time float: no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def check_arch(arch: str, option: str = "--arch") -> None:
    try:
        target = target_for_arch(arch)
    except ValueError as err:
        raise CLIError(f"{option}: {err}") from None
    if target.vendor == "amd":
        import importlib.util

        if importlib.util.find_spec("llvmlite") is None:
            raise CLIError(
                f"{option} {arch}: AMD code objects need the amd extra "
                "(pip install 'kbuild[amd]': llvmlite and an ld.lld)",
                1,
            )


def cache_root(args, must_exist: bool = False) -> str:
    """The cache folder the command works on: --cache-dir, else the default. A path that is
    not a folder is an error; with `must_exist`, so is a missing one."""
    given = getattr(args, "cache_dir", None)
    root = Path(given).expanduser() if given else default_cache_dir()
    origin = "--cache-dir" if given else "the cache folder ($KBUILD_CACHE_DIR or the default)"
    if root.exists() and not root.is_dir():
        raise CLIError(f"{origin}: {root} is not a folder")
    if must_exist and not root.exists():
        raise CLIError(f"no cache at {root} ({origin}): nothing compiled there yet", 1)
    return str(root)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), naming the command and where help is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


CACHE_DIR_HELP = (
    "cache folder (default: $KBUILD_CACHE_DIR, else $XDG_CACHE_HOME/kbuild, else ~/.cache/kbuild)"
)
