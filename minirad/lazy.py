"""Lazy package exports (PEP 562), so importing a package imports none of its heavy modules.

``minirad``, ``minirad.engine`` and ``minirad.models`` name what they export and the module that
defines each name; a name is imported on first use. ``minirad --help`` and the CLI's flag checks
(``minirad.engine.sampling_params``) thus never import torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose ``exports`` map a public name to
    the module (relative to the package) that defines it.

    The ``__getattr__`` raises AttributeError for a name not in ``exports`` (``from package
    import x`` then falls back to importing the submodule ``package.x``).
    """

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
