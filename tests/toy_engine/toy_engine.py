"""A toy engine registered from outside the package, through an entry point alone
(toy_engine-0.1.dist-info/entry_points.txt, group logit_matrix.backends): its logits are a fixed
function of the token ids, so it needs no library and its rows are the same on every machine.
tests/test_toy_engine.py puts this directory on the path and runs a spec that names it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backends.base import Backend


class ToyBackend(Backend):
    engine = "toy"
    dtypes = frozenset({"fp32"})
    attention = frozenset({"default"})
    devices = frozenset({"cpu"})
    libraries = ("numpy",)

    def load(self) -> None:
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.waves = np.arange(self.vocab, dtype=np.float64) / self.vocab

    def settings(self) -> dict:
        return {"dtype": self.stack.dtype, "logits": "sin of the last two token ids over the vocabulary"}

    def vocab_size(self) -> int:
        return self.vocab

    def forward(self, token_ids: list[int], positions: list[int]) -> np.ndarray:
        out = np.empty((len(positions), self.vocab), np.float32)
        for i, p in enumerate(positions):
            prev = token_ids[p - 1] if p else 0
            out[i] = 4.0 * np.sin(self.waves * (token_ids[p] % 97 + 1) + prev % 13)
        return out
