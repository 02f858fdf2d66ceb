"""Which positions of a prompt a stack keeps: the spec's `stride:` or its `positions:` window.

    stride: 32                                   every 32nd position from 0, plus the last (default)
    positions: {from: 256, to: 510, stride: 1}   a window; `to` is inclusive, negative counts from the end
    positions: {from: half, to: -2}              from the middle of each prompt to its second-to-last
    positions: llama_perplexity                  the rows llama-perplexity scores: n//2 .. n-2

Row p holds the distribution over token p+1, so a stack is fed only ids[0..last kept p]:
a window that ends early costs no forward work past it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KEYS = ("from", "to", "stride", "last")


@dataclass(frozen=True)
class Positions:
    stride: int = 32
    start: int | str = 0  # a position, or "half": n // 2 of each prompt (llama-perplexity's `first`)
    stop: int | None = None  # inclusive; negative counts from the end (-1 = the last); None: the last
    last: bool = True  # also keep each prompt's last position

    @classmethod
    def every(cls, stride: int) -> "Positions":
        return cls(stride=stride)

    @property
    def is_plain(self) -> bool:
        """The `stride: N` form: a cell id hashes its positions only when they are not this."""
        return self.start == 0 and self.stop is None and self.last

    def of(self, n_tokens: int) -> list[int]:
        """The kept positions of a prompt of n_tokens, ascending (empty when the window misses it)."""
        if n_tokens < 1:
            return []
        lo = n_tokens // 2 if self.start == "half" else int(self.start)
        hi = n_tokens - 1 if self.stop is None else self.stop if self.stop >= 0 else n_tokens + self.stop
        hi = min(hi, n_tokens - 1)
        pos = list(range(lo, hi + 1, self.stride)) if 0 <= lo <= hi else []
        if self.last and (not pos or pos[-1] != n_tokens - 1):
            pos.append(n_tokens - 1)
        return pos

    def fed(self, ids: list[int], max_tokens: int | None = None) -> tuple[list[int], list[int]]:
        """The ids a stack is fed and the positions kept: only the prefix the last kept position
        needs is fed (row p depends on ids[0..p] alone, so those rows mean what the whole prompt's
        do), and max_tokens keeps the positions below it. ([], []) when none is kept."""
        positions = self.of(len(ids))
        if max_tokens is not None:
            positions = [p for p in positions if p < max_tokens]
        return (ids[: positions[-1] + 1], positions) if positions else ([], [])

    def to_dict(self) -> dict:
        return {"from": self.start, "to": self.stop, "stride": self.stride, "last": self.last}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> str:
        if self.is_plain:
            return "every stride-th position from 0, plus each prompt's last"
        lo = "n/2" if self.start == "half" else str(self.start)
        hi = "the last" if self.stop is None else str(self.stop) if self.stop >= 0 else f"n{self.stop}"
        tail = ", plus each prompt's last" if self.last else ""
        return f"positions {lo} to {hi} (inclusive, n = prompt length) every {self.stride}{tail}"


# perplexity.cpp's `first = n_ctx/2` .. n_ctx - 2: the rows its KL is over (store/llamacpp_kld.py too)
LLAMA_PERPLEXITY = Positions(stride=1, start="half", stop=-2, last=False)
PRESETS = {"llama_perplexity": LLAMA_PERPLEXITY}


def next_ids(ids: list[int], positions: list[int]) -> list[int | None]:
    """The token each kept row predicts: ids[p + 1] of the whole prompt (a window or a prefix feeds
    less); only the prompt's last row has none."""
    return [ids[p + 1] if p + 1 < len(ids) else None for p in positions]


def parse(raw, fld: str, err) -> Positions:
    """A spec's `positions:` value (a preset name or a mapping); err(field, message, value) -> exception."""
    if isinstance(raw, str):
        if raw not in PRESETS:
            raise err(
                fld, f"unknown preset; expected one of {', '.join(PRESETS)} or a mapping of {', '.join(KEYS)}", raw
            )
        return PRESETS[raw]
    if not isinstance(raw, dict) or not raw:
        raise err(fld, f"must be a preset name or a mapping of {', '.join(KEYS)}", raw)
    for k in raw:
        if k not in KEYS:
            raise err(f"{fld}.{k}", f"unknown key; expected one of {', '.join(KEYS)}", ...)
    stride = raw.get("stride", 1)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise err(f"{fld}.stride", "must be a positive integer", stride)
    start = raw.get("from", 0)
    if start != "half" and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise err(f"{fld}.from", "must be a position >= 0 or 'half'", start)
    stop = raw.get("to")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int)):
        raise err(f"{fld}.to", "must be a position (negative: from the end) or null", stop)
    if isinstance(start, int) and stop is not None and stop >= 0 and stop < start:
        raise err(f"{fld}.to", f"must not be before from ({start})", stop)
    last = raw.get("last", False)
    if not isinstance(last, bool):
        raise err(f"{fld}.last", "must be true or false", last)
    return Positions(stride=stride, start=start, stop=stop, last=last)


def from_dict(d: dict | None, stride: int) -> Positions:
    """What a cells row or a Work records back into Positions (None: the plain stride form)."""
    if not d:
        return Positions.every(stride)
    return Positions(stride=d["stride"], start=d["from"], stop=d["to"], last=d["last"])
