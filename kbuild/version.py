"""kbuild's version (pyproject.toml's), for the CLI and the cache bundles' index."""

__version__ = "0.1.0"
