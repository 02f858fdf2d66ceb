"""Groups of a GGUF's weight tensors, named by anchored patterns that llama.cpp's quantiser takes as
per-tensor type overrides (llama-quantize --tensor-type PATTERN=TYPE and --tensor-type-file; the
`tt_overrides` of llama_model_quantize_params, src/llama-quant.cpp): each tensor takes the type of
the first pattern std::regex_search finds in its name, then llama.cpp's fallback where its rows do
not divide into the type's blocks (Q4_K -> Q5_0 at n_embd 576, for instance).

Patterns are anchored (`^blk\\.\\d+\\.attn_output\\.weight$`, never a bare `output`, which would also
match every attn_output), lower case and free of spaces: llama-quantize lowercases the name part and
reads a --tensor-type-file as whitespace-separated words (tools/quantize/quantize.cpp). They mean the
same to std::regex (ECMAScript) and Python's re.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError

# the weight kinds, in the order a model applies them; `output` only where the model has its own
# (SmolLM2 and Gemma 3 tie it to token_embd)
KINDS = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DEPTHS = ("first third", "middle third", "last third")


@dataclass(frozen=True)
class Group:
    name: str  # "attn_v", "first third"
    pattern: str  # anchored regex over tensor names
    tensors: tuple[str, ...]  # the quantisable tensors it names in this file

    def line(self, ggml_type: str) -> str:
        """Its --tensor-type-file line for a type (`q8_0`)."""
        return f"{self.pattern}={ggml_type.lower()}"


def flag_name(name: str) -> str:
    """A group's name as a command line and a file name write it: `first third` -> `first_third`."""
    return name.replace(" ", "_")


def kind_pattern(kind: str) -> str:
    return rf"^blk\.\d+\.{kind}\.weight$" if kind.startswith(("attn_", "ffn_")) else rf"^{kind}\.weight$"


def depth_pattern(layers: list[int]) -> str:
    return rf"^blk\.({'|'.join(str(i) for i in layers)})\..+\.weight$"


def quantisable(path: str | Path) -> list[tuple[str, str]]:
    """[(name, ggml type name)] of the tensors llama.cpp's quantiser may change: its weights of two
    or more dimensions (norms and biases stay as they are, src/llama-quant.cpp
    tensor_allows_quantization), in file order."""
    from gguf import GGMLQuantizationType

    from common.gguf_header import read_tensor_shapes

    return [
        (name, GGMLQuantizationType(t).name)
        for name, t, shape in read_tensor_shapes(path)
        if name.endswith(".weight") and len(shape) >= 2
    ]


def groups(path: str | Path, wanted: tuple[str, ...] | None = None) -> list[Group]:
    """The file's groups by kind, then by depth (the layers cut into thirds), each with the tensors
    it names; a kind the model lacks is left out. wanted: only these group names (`first third`
    may be written first_third), in that order; an unknown name is refused naming what there is."""
    names = [n for n, _ in quantisable(path)]
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"blk\.(\d+)\.", n))})
    out = []
    for kind in KINDS:
        out.append(Group(kind, kind_pattern(kind), ()))
    # numpy.array_split's cut: the first len % 3 thirds take one layer more
    q, r = divmod(len(layers), 3)
    ends = [0]
    for i in range(3):
        ends.append(ends[-1] + q + (i < r))
    thirds = [layers[ends[i] : ends[i + 1]] for i in range(3)]
    for name, part in zip(DEPTHS, thirds):
        if part:
            out.append(Group(name, depth_pattern(part), ()))
    found = [Group(g.name, g.pattern, tuple(n for n in names if re.search(g.pattern, n))) for g in out]
    found = [g for g in found if g.tensors]
    if wanted is None:
        return found
    by_name = {flag_name(g.name): g for g in found}
    unknown = [w for w in wanted if flag_name(w) not in by_name]
    if unknown:
        raise UserError(f"--groups {','.join(unknown)}: no such group in {path} (it has {', '.join(by_name)})")
    return [by_name[flag_name(w)] for w in wanted]


def uncovered(path: str | Path, found: list[Group]) -> list[str]:
    """The quantisable tensors no kind group names (MoE experts, fused QKV, ...): only the thirds
    reach them."""
    named = {n for g in found if g.name in KINDS for n in g.tensors}
    return [n for n, _ in quantisable(path) if n not in named]


def parse_line(line: str) -> tuple[str, str]:
    """PATTERN=TYPE as llama-quantize reads it: the pattern lower-cased (so a `\\D` written there is a
    `\\d` to it, and here), a ggml type name in any case."""
    from gguf import GGMLQuantizationType

    pattern, sep, name = line.strip().partition("=")
    if not sep or not pattern or not name:
        raise UserError(f"tensor type {line!r}: not PATTERN=TYPE")
    try:
        GGMLQuantizationType[name.upper()]
    except KeyError:
        raise UserError(f"tensor type {line!r}: {name} is no ggml type") from None
    return pattern.lower(), name.lower()


def read_lines(text: str) -> tuple[str, ...]:
    """A --tensor-type-file's lines (whitespace-separated words, as llama-quantize reads it)."""
    return tuple("=".join(parse_line(w)) for w in text.split())


def overrides(lines: tuple[str, ...]):
    """The NULL-terminated llama_model_tensor_override array for llama_model_quantize_params.tt_overrides,
    and what must outlive the call (the pattern strings)."""
    import llama_cpp
    from gguf import GGMLQuantizationType

    parsed = [parse_line(x) for x in lines]
    arr = (llama_cpp.llama_model_tensor_override * (len(parsed) + 1))()
    keep = []
    for o, (pattern, name) in zip(arr, parsed):
        b = pattern.encode()
        keep.append(b)
        o.pattern, o.type = b, int(GGMLQuantizationType[name.upper()])
    arr[len(parsed)].pattern = None
    return ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override)), (arr, keep)
