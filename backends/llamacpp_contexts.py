"""llama.cpp contexts as LlamaCppBackend evaluates in them (llama-cpp-python, low-level API): a
context per prompt length with its KV cache cleared between prompts, token batches fed through
llama_decode with the logits of the wanted positions read back, one token at a time for a decode,
and a prompt's state saved and restored for a warm prompt cache. What it needs of the backend:
_lc (llama_cpp), model, threads, n_batch, n_ubatch, kv_cache, stack.attention, _n_vocab and
_lanes (Lanes, set by LlamaCppBackend.load).

Lanes: a capture may run two prompts' forwards at once, each in a context of its own on its own
share of the threads (Backend.lanes). On 2 cores two 1-thread forwards at once took 0.90x
(SmolLM2-135M) and 0.77x (Gemma 3 270M) of one 2-thread forward after the other, with the same
logits bit for bit on both (and tests/test_lanes.py on SmolLM2's F16 cut): what the split saves
is the threads' wait for each other at every graph node.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from typing import Iterator

import numpy as np

from backends.base import OutputRing, block_rows, stream_bytes

# common/kv_cache.py TYPES -> enum ggml_type (ggml/include/ggml.h), by number: llama-cpp-python
# exports no GGML_TYPE_BF16
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}


class Lane:
    """What one forward at a time needs of its own: its threads, the context kept from its last
    prompt (n_ctx, context, params) and its ring of output buffers."""

    def __init__(self, threads: int):
        self.threads, self.kept, self.outputs = threads, None, OutputRing(0)


class Lanes:
    """The lanes of one loaded model: `whole` (every thread) for a call from any thread not bound
    to a lane, and, where the threads split, `split` lanes a thread binds itself to (bind)."""

    def __init__(self, threads: int, n: int):
        self.whole = Lane(threads)
        self.split = [Lane(threads // n + (i < threads % n)) for i in range(n)] if n > 1 else []
        self.local = threading.local()

    def here(self) -> Lane:
        return getattr(self.local, "lane", None) or self.whole

    def bind(self, i: int) -> None:
        self.local.lane = self.split[i]

    def every(self) -> list[Lane]:
        return [self.whole, *self.split]


class LlamaContexts:
    """The evaluation half of LlamaCppBackend: forward, decode and warm_rows over llama.cpp contexts."""

    def _flash(self) -> int:
        lc = self._lc
        if self.stack.attention == "default" and self.kv_cache.quantised_v:
            # only the flash-attention kernel reads a quantised V cache (src/llama-context.cpp: "quantized
            # V cache requires flash_attn"): asked for here rather than left to llama.cpp's auto
            return lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        return {
            "default": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "flash_attn": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "eager": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[self.stack.attention]

    def _context(self, n_ctx: int, taps=None, n_seq: int = 1):
        """A fresh context (nothing cached) for n_ctx tokens of n_seq sequences, with its params."""
        lc = self._lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(self.n_batch, max(n_ctx, 1))
        cp.n_ubatch = min(self.n_ubatch, cp.n_batch)
        cp.n_seq_max = n_seq
        # one KV buffer for every sequence (llama-server's --kv-unified): split, each would get
        # n_ctx / n_seq cells, and sequences of other lengths would not fit
        cp.kv_unified = n_seq > 1
        cp.n_threads = cp.n_threads_batch = self._lanes.here().threads
        cp.type_k, cp.type_v = KV_TYPES[self.kv_cache.k], KV_TYPES[self.kv_cache.v]
        cp.flash_attn_type = self._flash()
        cp.no_perf = True
        if taps is not None:
            cp.cb_eval = taps.callback
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx, cp

    def _feed(
        self,
        ctx,
        batch,
        n_batch: int,
        tokens: list[int],
        first: int,
        want: dict[int, int],
        out: np.ndarray | None,
        taps=None,
        n_ubatch: int = 0,
    ) -> None:
        """Decode tokens at positions first.. in batches of n_batch; the logits of each position in
        want go to out[want[position]] (out None: they stay in llama.cpp's output buffer)."""
        lc = self._lc
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start : start + n_batch]
            batch.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                batch.token[j] = tok
                batch.pos[j] = first + start + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = (first + start + j) in want
            if taps is not None:
                taps.at(start, n_ubatch=n_ubatch, n_tokens=len(chunk))
            rc = lc.llama_decode(ctx, batch)
            if taps is not None and taps.error is not None:
                raise taps.error
            if rc != 0:
                raise RuntimeError(
                    f"llama_decode returned {rc} at positions {first + start}..{first + start + len(chunk) - 1}"
                )
            for j in range(len(chunk) if out is not None else 0):
                if (first + start + j) in want:
                    ptr = lc.llama_get_logits_ith(ctx, j)
                    out[want[first + start + j]] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _prefill_context(self, n_ctx: int):
        """A context for n_ctx tokens with an empty KV cache: the last prompt's when it had this
        length, cleared (llama_memory_clear), else a new one. The output and compute buffers are
        then allocated once, not per prompt, where allocating them costs time at a large vocabulary
        (docs/benchmark-notes.md); the logits are the same bits as a fresh context's."""
        lane = self._lanes.here()
        if lane.kept is not None and lane.kept[0] == n_ctx:
            self._lc.llama_memory_clear(self._lc.llama_get_memory(lane.kept[1]), True)
            return lane.kept[1], lane.kept[2]
        self._drop_kept(lane)
        ctx, cp = self._context(n_ctx)
        lane.kept = (n_ctx, ctx, cp)
        return ctx, cp

    def _drop_kept(self, lane: Lane | None = None) -> None:
        """Free the context a lane (the calling thread's by default) kept from its last prompt."""
        lane = lane or self._lanes.here()
        kept, lane.kept = lane.kept, None
        if kept is not None:
            self._lc.llama_free(kept[1])

    def forward(self, token_ids: list[int], positions: list[int], taps=None) -> np.ndarray:
        # a forward that taps layers sets its own eval callback: a context of its own
        ctx, cp = self._context(len(token_ids), taps) if taps is not None else self._prefill_context(len(token_ids))
        want = {p: i for i, p in enumerate(positions)}
        out = self._lanes.here().outputs.take((len(positions), self._n_vocab), np.float32)  # (rows, vocab)
        batch = self._lc.llama_batch_init(cp.n_batch, 0, 1)
        try:
            self._feed(ctx, batch, cp.n_batch, token_ids, 0, want, out, taps, cp.n_ubatch)
        except BaseException:
            if taps is None:
                self._drop_kept()  # a failed decode leaves the cache in no known state
            raise
        finally:
            self._lc.llama_batch_free(batch)
            if taps is not None:
                self._lc.llama_free(ctx)
        return out

    def forward_batch(self, token_ids: list[int], positions: list[int], others: list[list[int]]) -> np.ndarray:
        """Several sequences in one llama_batch, as llama-server's slots share a decode: sequence s's
        tokens carry seq_id s, the sequences follow one another (token_ids first) in llama_decode
        calls of at most n_batch tokens, which llama.cpp cuts into ubatches of n_ubatch; one unified
        KV cache holds them all. Only sequence 0's kept positions ask for logits."""
        lc, seqs = self._lc, [token_ids, *others]
        flat = [(tok, pos, s) for s, seq in enumerate(seqs) for pos, tok in enumerate(seq)]  # (tokens,) in batch order
        ctx, cp = self._context(len(flat), n_seq=len(seqs))
        want = {p: i for i, p in enumerate(positions)}
        out = self._lanes.here().outputs.take((len(positions), self._n_vocab), np.float32)  # (rows, vocab)
        batch = lc.llama_batch_init(cp.n_batch, 0, len(seqs))
        try:
            for start in range(0, len(flat), cp.n_batch):
                chunk = flat[start : start + cp.n_batch]
                batch.n_tokens = len(chunk)
                for j, (tok, pos, s) in enumerate(chunk):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                    batch.seq_id[j][0] = s
                    batch.logits[j] = s == 0 and pos in want
                rc = lc.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc} for batch tokens {start}..{start + len(chunk) - 1}")
                for j, (_, pos, s) in enumerate(chunk):
                    if s == 0 and pos in want:
                        ptr = lc.llama_get_logits_ith(ctx, j)
                        out[want[pos]] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return out

    def streams(self, rows: int) -> bool:
        return rows * 4 * self._n_vocab > stream_bytes()

    def forward_blocks(self, token_ids: list[int], positions: list[int]) -> Iterator[np.ndarray]:
        """The prefill in llama_decode calls of at most n_batch tokens, each ending at most
        block_rows() kept positions in; each call's kept rows handed over as a view of llama.cpp's
        own output buffer (no copy), valid until the next call. Tokens with no kept row go in calls
        of n_batch. The calls' bounds change how the ubatches are cut; on the CPU the rows stay
        those of one call, bit for bit (tests/test_streamed_rows.py), and the block is recorded."""
        if not self.streams(len(positions)):
            yield self.forward(token_ids, positions)
            return
        lane = self._lanes.here()  # the generator may be resumed, or closed, from another thread
        ctx, cp = self._prefill_context(len(token_ids))
        want, per = list(positions), block_rows(self._n_vocab)
        assert want == sorted(want), "kept positions come in ascending order"
        batch, at, start = self._lc.llama_batch_init(cp.n_batch, 0, 1), 0, 0
        try:
            while start < len(token_ids):
                end = min(start + cp.n_batch, len(token_ids))
                if at + per < len(want):  # the call ends before the kept row one block on
                    end = min(end, want[at + per])
                kept = want[at : bisect.bisect_left(want, end, lo=at)]
                self._feed(ctx, batch, cp.n_batch, token_ids[start:end], start, dict.fromkeys(kept, 0), None)
                if kept:
                    yield self._outputs_view(ctx, kept, start)  # (block rows, vocab)
                at, start = at + len(kept), end
        except BaseException:
            self._drop_kept(lane)  # a forward left half done leaves the cache in no known state
            raise
        finally:
            self._lc.llama_batch_free(batch)

    def _outputs_view(self, ctx, kept: list[int], first: int) -> np.ndarray:
        """The last decode's rows at kept positions as one (rows, vocab) array: a view of llama.cpp's
        output buffer where they lie there in order (a single sequence's outputs do), else a copy."""
        lc, v = self._lc, self._n_vocab
        ptrs = [ctypes.cast(lc.llama_get_logits_ith(ctx, p - first), ctypes.c_void_p).value for p in kept]
        if all(b - a == 4 * v for a, b in zip(ptrs, ptrs[1:])):
            return np.ctypeslib.as_array(ctypes.cast(ptrs[0], ctypes.POINTER(ctypes.c_float)), shape=(len(kept), v))
        out = np.empty((len(kept), v), np.float32)
        for i, p in enumerate(kept):
            out[i] = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, p - first), shape=(v,))
        return out

    def decode(self, token_ids: list[int], at: int, steps: int) -> np.ndarray:
        """The prefill into the context's KV cache, then one llama_decode of one token per step
        (n_tokens = 1: the kernels a server's decode runs)."""
        ctx, cp = self._context(at + steps + 1)
        out = np.empty((steps, self._n_vocab), dtype=np.float32)  # (steps, vocab)
        batch = self._lc.llama_batch_init(cp.n_batch, 0, 1)
        try:
            self._feed(ctx, batch, cp.n_batch, token_ids[: at + 1], 0, {}, None)
            for s in range(1, steps + 1):
                self._feed(ctx, batch, 1, [token_ids[at + s]], at + s, {at + s: s - 1}, out)
        finally:
            self._lc.llama_batch_free(batch)
            self._lc.llama_free(ctx)
        return out

    def chunked_rows(self, token_ids: list[int], positions: list[int], chunk: int) -> np.ndarray:
        """The prompt in llama_decode calls of `chunk` tokens, each continuing the KV cache the
        calls before it filled (n_batch = chunk: what llama-server does with a prompt longer than
        its batch), in a fresh context."""
        if chunk > self.n_batch and len(token_ids) > self.n_batch:
            raise RuntimeError(f"prefill_chunk {chunk} is past this cell's n_batch {self.n_batch}: set n_batch >= it")
        ctx, cp = self._context(len(token_ids))
        want = {p: i for i, p in enumerate(positions)}
        out = np.empty((len(positions), self._n_vocab), dtype=np.float32)  # (rows, vocab)
        batch = self._lc.llama_batch_init(cp.n_batch, 0, 1)
        try:  # a prompt no longer than the chunk is one call (cp.n_batch is its length then)
            self._feed(ctx, batch, min(chunk, cp.n_batch), token_ids, 0, want, out, None)
        finally:
            self._lc.llama_batch_free(batch)
            self._lc.llama_free(ctx)
        return out

    def whole_prefill(self) -> dict[str, int]:
        """What feeds a prompt whole here: llama_decode calls of n_batch tokens, cut into ubatches
        of n_ubatch (a prompt longer than either is already chunked in the capture)."""
        return {"n_batch": self.n_batch, "n_ubatch": self.n_ubatch}

    # how warm_rows reuses a cache, recorded in the settings of a cell that checks it
    warm_rule = (
        "check: state saved, restored into a fresh context, all but the last token "
        "kept (llama_memory_seq_rm), the last one evaluated alone"
    )

    def warm_rows(self, token_ids: list[int], positions: list[int]) -> tuple[int, np.ndarray]:
        """A prompt cache serving the same request again (llama-server's cache_prompt, llama-cpp-python's
        LlamaRAMCache): the first evaluation's state saved (llama_state_get_data) and restored into a
        fresh context, the cache kept for all but the last token, which is evaluated again alone
        (n_tokens = 1: a cache holds no logits), the case of ggml-org/llama.cpp#2838."""
        lc, n = self._lc, len(token_ids)
        ctx, cp = self._context(n)
        batch = lc.llama_batch_init(cp.n_batch, 0, 1)
        try:
            self._feed(ctx, batch, cp.n_batch, token_ids, 0, {}, None)
            size = lc.llama_state_get_size(ctx)
            state = (ctypes.c_uint8 * size)()
            size = lc.llama_state_get_data(ctx, state, size)
        finally:
            lc.llama_free(ctx)
        hit = n - 1
        keep = [p for p in positions if p >= hit]
        out = np.empty((len(keep), self._n_vocab), dtype=np.float32)  # (rows, vocab)
        ctx, cp = self._context(n)
        try:
            if lc.llama_state_set_data(ctx, state, size) != size:
                raise RuntimeError(f"llama_state_set_data did not read the {size} bytes of the saved state")
            if not lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, hit, -1):
                raise RuntimeError(f"llama_memory_seq_rm could not drop positions {hit}.. from the restored cache")
            self._feed(ctx, batch, cp.n_batch, token_ids[hit:], hit, {p: i for i, p in enumerate(keep)}, out)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return hit, out
