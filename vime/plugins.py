"""Load a user function named on the command line: `path/to/file.py:fn`, `package.module:fn` or
`package.module.fn` (slime's dotted form).

This is the convention of `--custom-rm-path` (`vime.rewards.custom`), made generic so other hooks
(`--dynamic-sampling-filter-path`) load user code the same way and name their own flag in errors.
Every problem (file missing, module not importable, error while importing, no such attribute, not
callable) raises `PluginLoadError` (or the subclass the caller names) with a message naming the flag, the
spec and what is wrong, so a bad spec fails at start-up, not mid-run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PluginLoadError(ValueError):
    """A spec that does not name a usable function; the message says which flag and why."""


def split_spec(spec: str, flag: str, error: type[PluginLoadError] = PluginLoadError) -> tuple[str, str]:
    """(`file.py` or module, attribute) of a spec; raises `error` when it names no function."""
    spec = spec.strip()
    usage = "expected 'path/to/file.py:function' or 'module:function'"
    if not spec:
        raise error(f"{flag} is empty; {usage}")
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.rpartition(".")
        if spec.endswith(".py") or not target:
            raise error(f"{flag} {spec!r} names no function; {usage}")
    if not target or not attr:
        raise error(f"{flag} {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    return target, attr


def _load_file(path_text: str, spec: str, flag: str, error: type[PluginLoadError], what: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        where = f" (resolved to {path.resolve()})" if not path.is_absolute() else ""
        raise error(f"{what or 'file'} not found: {path_text}{where}, from {flag} {spec!r}")
    resolved = path.resolve()
    # One stable module name per file, so two hooks both called filters.py do not collide.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"vime_plugin_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise error(f"cannot import {resolved} as Python (from {flag} {spec!r})")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before exec: dataclasses/typing in the file look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        named = f"{what} {resolved}" if what else str(resolved)
        raise error(f"error while importing {named} (from {flag} {spec!r}): {type(exc).__name__}: {exc}") from exc
    return module


def _load_module(name: str, spec: str, flag: str, error: type[PluginLoadError]) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise error(
            f"cannot import module {name!r} from {flag} {spec!r}: {exc} (for a file, write 'path/to/file.py:function')"
        ) from exc
    except Exception as exc:
        raise error(f"error while importing module {name!r} from {flag} {spec!r}: {type(exc).__name__}: {exc}") from exc


def load_function(
    spec: str, flag: str, *, error: type[PluginLoadError] = PluginLoadError, what: str = ""
) -> Callable[..., Any]:
    """Import and return the callable `spec` names; `flag` (e.g. '--dynamic-sampling-filter-path') is
    quoted in every error. Errors are raised as `error` (a PluginLoadError subclass of the caller's);
    `what` (e.g. 'custom reward file') names a spec's file in the not-found and import-error messages."""
    target, attr = split_spec(spec, flag, error)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, spec, flag, error, what) if is_file else _load_module(target, spec, flag, error)
    if not hasattr(module, attr):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{target} has no function {attr!r} (from {flag} {spec!r}); callables there: {available}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise error(f"{target}:{attr} is a {type(fn).__name__}, not a callable (from {flag} {spec!r})")
    return fn  # type: ignore[no-any-return]


def split_named_specs(specs: list[str], flag: str, error: type[PluginLoadError] = PluginLoadError) -> list[tuple[str, str]]:
    """`NAME=SPEC` entries (`--tool`, `--environment`) as (name, spec) pairs; raises `error` for an entry
    without a name or a spec, and for a name given twice."""
    pairs: list[tuple[str, str]] = []
    for entry in specs:
        name, sep, spec = (part.strip() for part in entry.partition("="))
        if not sep or not name or not spec:
            raise error(f"{flag} {entry!r}: expected NAME=path/to/file.py:function or NAME=module:function")
        if name in dict(pairs):
            raise error(f"{flag}: the name {name!r} is given twice")
        pairs.append((name, spec))
    return pairs
