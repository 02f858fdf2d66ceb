"""Backend registry: engine name -> "module:Class", imported only when used.

Built-in backends are registered exactly like outside plugins, which add an
entry point in the group ``logit_matrix.backends`` (name = engine name,
value = ``"package.module:Class"``). Importing a backend module must not import
its engine library: capability flags are plain class attributes, and the heavy
import happens in ``load()``.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.base import Backend
    from common.stack import Cell

BUILTIN = {
    "hf": "backends.hf_backend:HFBackend",
    "llamacpp": "backends.llamacpp_backend:LlamaCppBackend",
    "mlx": "backends.mlx_backend:MLXBackend",
    "trtllm": "backends.trtllm_backend:TrtllmBackend",
    # vLLM runs under its own interpreter (see vllm_backend.vllm_python), so no REQUIRES entry
    "vllm": "backends.vllm_backend:VLLMBackend",
}


def registry() -> dict[str, str]:
    found = dict(BUILTIN)
    for ep in entry_points(group="logit_matrix.backends"):
        found.setdefault(ep.name, ep.value)
    return found


# The library each built-in backend needs at load time: without it the cell is skipped, with the reason.
REQUIRES = {"hf": "transformers", "llamacpp": "llama_cpp", "mlx": "mlx_lm", "trtllm": "tensorrt_llm"}


def backend_class(engine: str) -> type[Backend] | None:
    target = registry().get(engine)
    if target is None:
        return None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def unsupported_reason(cell: Cell) -> str | None:
    """Why this cell cannot run with the installed backends, or None."""
    cls = backend_class(cell.engine)
    if cls is None:
        return f"no backend for engine '{cell.engine}' is installed (available: {', '.join(registry())})"
    lib = REQUIRES.get(cell.engine)
    if lib and importlib.util.find_spec(lib) is None:
        return f"engine {cell.engine} needs the Python package '{lib}', which is not installed"
    return cls.unsupported(cell)
