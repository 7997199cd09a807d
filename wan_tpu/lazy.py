"""Lazy re-exports: a package names its public objects without importing the modules that define them,
so `import wan_tpu` (and a family package) costs no jax, flax or torch import until a name is used."""

from __future__ import annotations

import importlib


def exports(package: str, table: dict[str, str]):
    """A module `__getattr__` for `package` that imports `table[name]` (a module path) on first use."""

    def __getattr__(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
