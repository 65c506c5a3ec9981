"""Load user code named `path/to/file.py:function` or `module:function`.

The reward plug-ins (services/scorer/rewards/registry.py) and the rollout's user tools
(docs/rollout.md, "Tool calls") name functions the same way and both load them here (services
may not import each other). The file form executes the file as a module of its
own (named after its absolute path, so two `tools.py` files never replace each other and a
second load is the cached module); a relative path counts from the working directory. Every
failure is a ValueError whose one-line message starts with `what` (the config entry), so the
user sees which entry is wrong.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_file_ref(module_part: str) -> bool:
    """`path/to/tools.py` (a file) rather than `package.module`."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def load_ref(ref: str, what: str, module_prefix: str = "forage_plugin_") -> Callable[..., Any]:
    """The callable `ref` names; ValueError(`what`: reason) when it cannot be loaded."""
    module_part, sep, attr_path = ref.rpartition(":")
    if not sep or not module_part or not attr_path:
        raise ValueError(f"{what}: {ref!r} must look like 'path/to/file.py:function' or "
                         f"'module:function'")
    if is_file_ref(module_part):
        target: Any = _load_file(what, module_part, module_prefix)
    else:
        target = _import_module(what, module_part)
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise ValueError(f"{what}: {module_part} has no {attr_path}")
        target = getattr(target, attr)
    if not callable(target):
        raise ValueError(f"{what}: {ref} is not callable")
    return target


def _load_file(what: str, file_part: str, prefix: str) -> Any:
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        shown = file_part if Path(file_part).is_absolute() else f"{file_part} (= {path})"
        raise ValueError(f"{what}: file {shown} does not exist")
    name = prefix + hashlib.sha1(str(path).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: {path} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and the like look their module up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{what}: {path} raised on import: "
                         f"{type(exc).__name__}: {exc}") from None
    return module


def _import_module(what: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = str(Path.cwd())
        here = Path(cwd, *module_name.split("."))
        in_cwd = here.with_suffix(".py").is_file() or (here / "__init__.py").is_file()
        if exc.name != top or not in_cwd or cwd in sys.path:
            raise ValueError(f"{what}: cannot import {module_name}: {exc}") from None
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import {module_name}: {exc}") from None
    # `python -m` puts the working directory on sys.path; the `forage` script does not.
    sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import {module_name}: {exc}") from None
