"""Tokenizer / BOS parity: the ids an engine would make from the text vs the canonical ids.

Capture always feeds the canonical ids; this gate tells whether a user running
the engine on its own (text in) would have fed the same ids. Two separate
error sources: tokenisation/BOS changes the *input*; kernels change
the *logits* for identical input. A BOS slip shifts every logit and can pass
for quantisation error, so it is named, not just counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    match: bool
    first_diff: int | None
    diagnosis: str


def diagnose(canonical: list[int], engine: list[int], bos: int | None, vocab_size: int | None) -> Verdict:
    if engine == canonical:
        return Verdict(True, None, "ok")
    first = next((i for i, (a, b) in enumerate(zip(canonical, engine)) if a != b), min(len(canonical), len(engine)))
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in engine):
        return Verdict(False, first, "vocab mismatch")
    if bos is not None:
        if engine[:2] == [bos, bos] and canonical[:1] == [bos] and engine[1:] == canonical:
            return Verdict(False, first, "double BOS")
        if engine == [bos] + canonical:
            return Verdict(False, first, "extra BOS")
        if canonical == [bos] + engine:
            return Verdict(False, first, "missing BOS")
    return Verdict(False, first, "different ids")


def special_token_problems(reference: dict, engine: dict) -> list[str]:
    """Special-token ids that differ between the reference tokenizer and the engine's."""
    return [
        f"{k} id {engine.get(k)} vs reference {reference.get(k)}"
        for k in ("bos", "eos")
        if reference.get(k) is not None and engine.get(k) != reference.get(k)
    ]
