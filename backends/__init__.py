"""The engine registry: the one place engine names are listed.

An engine is a `backends.base.Backend` subclass. The built-in ones are in BUILTIN (engine name ->
"module:Class"); an outside one adds an entry point in the group ``logit_matrix.backends`` (name =
engine name, value = ``"package.module:Class"``). Both are imported only when asked for, and
importing a backend module must not import its engine library: what an engine runs (dtypes,
attention, devices, the files it runs as they are, the options it takes) is plain class
attributes, read here without loading anything heavy, and the heavy import happens in ``load()``.

Everything above this package that needs engine knowledge asks here: the spec's allowed values
and JSON Schema (the unions of what the engines declare), the default engine of a given file, and
each engine's declared properties (`declared`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.base import Backend
    from common.stack import Cell

GROUP = "logit_matrix.backends"

BUILTIN = {
    "hf": "backends.hf_backend:HFBackend",
    "llamacpp": "backends.llamacpp_backend:LlamaCppBackend",
    "mlx": "backends.mlx_backend:MLXBackend",
    "trtllm": "backends.trtllm_backend:TrtllmBackend",
    "vllm": "backends.vllm_backend:VLLMBackend",
}


@functools.cache
def registry() -> dict[str, str]:
    """Engine name -> "module:Class": the built-ins, then the entry points (a built-in's name wins)."""
    found = dict(BUILTIN)
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        found.setdefault(ep.name, ep.value)
    return found


def refresh() -> None:
    """Read the entry points again (after a distribution was installed into this process's path)."""
    registry.cache_clear()
    _loaded.cache_clear()


def engines() -> tuple[str, ...]:
    return tuple(registry())


def backend_class(engine: str) -> type[Backend] | None:
    target = registry().get(engine)
    if target is None:
        return None
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"engine '{engine}' ({target}, group {GROUP}) cannot be imported: {e}") from e
    if cls.engine != engine:
        raise TypeError(f"{target} is registered as engine '{engine}' but declares engine '{cls.engine}'")
    return cls


@functools.cache
def _loaded() -> tuple[dict[str, type[Backend]], dict[str, str]]:
    """(every registered engine's class that imports, by name; why each other one does not): an
    outside engine that fails to import is that engine's problem, not every engine's."""
    found, broken = {}, {}
    for name in registry():
        try:
            found[name] = backend_class(name)
        except (ImportError, TypeError) as e:
            broken[name] = str(e)
    return found, broken


def declared() -> dict[str, type[Backend]]:
    """Every registered engine's class that imports, by name (importing the backend modules, not the
    engines); `broken()` says why the others do not."""
    return _loaded()[0]


def broken() -> dict[str, str]:
    """Registered engines whose module cannot be imported here -> the reason (one line)."""
    return _loaded()[1]


def _union(attr: str) -> tuple[str, ...]:
    return tuple(sorted(set().union(*(getattr(cls, attr) for cls in declared().values()))))


def dtypes() -> tuple[str, ...]:
    """Every dtype some engine runs: the spec's allowed dtype values."""
    return _union("dtypes")


def attentions() -> tuple[str, ...]:
    return _union("attention")


def devices() -> tuple[str, ...]:
    return _union("devices")


def options() -> tuple[str, ...]:
    """Every spec option some engine takes."""
    return _union("options")


def as_is() -> frozenset[str]:
    """The engines whose cells without a weights recipe run the reference checkpoint's own weights
    at the cell's dtype (Backend.checkpoint_as_is), for the model card."""
    return frozenset(name for name, cls in declared().items() if cls.checkpoint_as_is)


def running(kind: str) -> tuple[str, ...]:
    """The engines that run a given file of this kind (base.FILE_KINDS) as it is, the default first."""
    found = [name for name, cls in declared().items() if kind in cls.runs_files]
    return tuple(sorted(found, key=lambda name: kind not in declared()[name].default_for))


def for_files(kind: str) -> type[Backend]:
    """The engine class a file of this kind defaults to (GGUF: llama.cpp), for what the spec asks of
    the file before any engine loads (Backend.file_tokenize, keep_file_vocabulary, checkpoint_dtype)."""
    name = default_engine(kind)
    if name is None:
        raise RuntimeError(f"no installed engine runs {kind} files (base.FILE_KINDS)")
    return backend_class(name)


def default_engine(kind: str) -> str | None:
    """The engine a given file of this kind runs on when its entry names none."""
    for name, cls in declared().items():
        if kind in cls.default_for:
            return name
    return None


def unsupported_reason(cell: Cell) -> str | None:
    """Why this cell cannot run with the installed backends, or None."""
    if cell.engine in broken():
        return broken()[cell.engine]
    cls = backend_class(cell.engine)
    if cls is None:
        return f"no backend for engine '{cell.engine}' is installed (available: {', '.join(registry())})"
    if cls.requires and importlib.util.find_spec(cls.requires) is None:
        return f"engine {cell.engine} needs the Python package '{cls.requires}', which is not installed"
    return cls.unsupported(cell)


def built_recipe(path) -> dict | None:
    """The recipe of a file this machine's artifact cache built (backends/artifacts.py recipe_of),
    or None for any other file: what the driver may say of a candidate beyond its header."""
    from backends.artifacts import recipe_of

    return recipe_of(path)
