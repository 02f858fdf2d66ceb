"""Batch composition, an axis of the sweep: a cell of batch B evaluates each prompt in the same
forward as B - 1 other sequences (its co-batched load) and keeps the measured prompt's rows only,
so its rows compare with batch 1's and with every other stack's.

    batch: [1, 8, 32]                                   sizes; the others are the corpus's prompts
    batch: {sizes: [1, 8], fill: corpus, seed: 0}       the same, with the fill policy named

    fill  corpus  the prompts after the measured one in corpus order, cycled, at their own lengths
          repeat  the measured prompt itself, B - 1 more times, each fed what it is fed (identical sequences)
          random  prompts drawn from the others with replacement, seeded per measured prompt

The measured prompt is sequence 0 of its batch, fed the prefix its kept rows need; every other
sequence is fed what a batch-free cell of the stack would be fed of it: at most max_tokens. Kernels pick
other tilings, split-K and reduction orders as the batch's shape changes (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025): that drift is what the axis measures.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

FILLS = ("corpus", "repeat", "random")
DEFAULT_FILL = "corpus"

# the spec value as JSON Schema (matrix/spec/schema.py)
_SIZES = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "array", "items": {"type": "integer", "minimum": 1}}]}
JSON_SCHEMA = {
    "anyOf": [
        _SIZES,
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["sizes"],
            "properties": {"sizes": _SIZES, "fill": {"enum": list(FILLS)}, "seed": {"type": "integer"}},
        },
    ]
}


@dataclass(frozen=True)
class Batch:
    """One cell's batch: its size and how the other B - 1 sequences are chosen."""

    size: int
    fill: str = DEFAULT_FILL
    seed: int = 0

    def id_part(self) -> dict:
        """What the cell id hashes: at size 1 no other sequence exists, so the policy does not count."""
        if self.size == 1:
            return {"size": 1}
        return {"size": self.size, "fill": self.fill, **({"seed": self.seed} if self.fill == "random" else {})}

    def to_json(self) -> str:
        return json.dumps(self.id_part(), sort_keys=True)

    def others(self, index: int, n_prompts: int) -> list[int]:
        """The corpus indices of the B - 1 sequences batched with prompt `index` (of n_prompts)."""
        k = self.size - 1
        if k == 0:
            return []
        if self.fill == "repeat" or n_prompts == 1:
            return [index] * k
        if self.fill == "corpus":
            return [(index + 1 + i) % n_prompts for i in range(k)]
        rng = random.Random(f"{self.seed}:{index}")  # a string seed: the same draw on every platform
        pool = [i for i in range(n_prompts) if i != index]
        return [rng.choice(pool) for _ in range(k)]


@dataclass(frozen=True)
class BatchAxis:
    """A spec's `batch:` value: the sizes to sweep and the one fill policy."""

    sizes: tuple[int, ...]
    fill: str = DEFAULT_FILL
    seed: int = 0

    def cells(self) -> list[Batch]:
        return [Batch(s, self.fill, self.seed) for s in self.sizes]


def parse(value, fail) -> BatchAxis | None:
    """A `batch:` spec value (an int, a list of ints, or {sizes, fill, seed}); None: batch-free.
    fail(msg, value, sub) makes the one-line error naming the field."""
    if value is None:
        return None
    raw = value if isinstance(value, dict) else {"sizes": value}
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"sizes", "fill", "seed"})
        if unknown:
            raise fail("unknown key; expected one of sizes, fill, seed", value[unknown[0]], f".{unknown[0]}")
        if "sizes" not in value:
            raise fail("needs sizes: a batch size or a list of them", value)
    sizes = raw["sizes"] if isinstance(raw["sizes"], list) else [raw["sizes"]]
    sub = ".sizes" if isinstance(value, dict) else ""
    if not sizes:
        raise fail("must name at least one batch size", raw["sizes"], sub)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise fail(
                "a batch size must be an integer >= 1", s, f"{sub}[{i}]" if isinstance(raw["sizes"], list) else sub
            )
    if len(set(sizes)) != len(sizes):
        raise fail("has duplicate batch sizes", raw["sizes"], sub)
    fill = raw.get("fill", DEFAULT_FILL)
    if fill not in FILLS:
        raise fail(f"unknown fill policy; expected one of {', '.join(FILLS)}", fill, ".fill")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("must be an integer", seed, ".seed")
    return BatchAxis(tuple(sizes), fill, seed)
