"""A vLLM v1 logits processor that teacher-forces decoding: a request whose SamplingParams carry
extra_args={"logit_matrix_force": [t1, t2, ...]} samples t1, then t2, ... whatever the model
prefers, so each decode step is fed the canonical next id (the decode path).

Imported only inside the vLLM environment (backends/vllm_backend.py loads it by name)."""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCE = "logit_matrix_force"


class TeacherForce(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.reqs: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (forced ids, its output ids so far)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def state(params, _prompt, out):  # out: the request's live output-token list
            forced = (params.extra_args or {}).get(FORCE) if params is not None else None
            return (list(forced), out) if forced else None

        process_dict_updates(self.reqs, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # (batch, vocab)
        for i, (forced, out) in self.reqs.items():
            k = len(out)  # tokens sampled so far: the next one is forced[k]
            if k < len(forced):
                logits[i] = float("-inf")
                logits[i, forced[k]] = 0.0
        return logits
