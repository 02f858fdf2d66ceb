"""Corpus loading and the one tokenisation every stack shares.

Texts are tokenised once, by the reference tokenizer of each model, under an
explicit BOS policy; the resulting ids (not the text) go to every stack.

An entry holds exactly one of:
    text / file   a text (file: relative to the corpus YAML)
    chat          messages rendered through the model's chat template
    ids           token ids, inline; used exactly as given
    ids_file      token ids from a .npy, a .parquet or a llama.cpp kl-divergence-base file

    chunks: N_CTX  (text, file, ids) tokenise once and cut into N_CTX-token prompts as
                   llama-perplexity does: len // N_CTX chunks, the tail dropped, each chunk's first
                   token replaced by BOS where BOS is added. A base file is already cut this way.
    max_chunks: N  (with chunks) only the first N of those chunks, as llama-perplexity's --chunks
                   (tools/perplexity/perplexity.cpp: n_chunk = min(n_chunks, len // n_ctx))
    vocab: F.gguf  (text, file) tokenise with llama.cpp's tokenizer from that GGUF's vocabulary, as
                   llama-perplexity does, instead of the reference tokenizer (the two disagree on
                   some texts; tokenizer_parity shows where)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import backends
from backends.base import GGUF
from common.errors import UserError, read_text_file, read_yaml_file
from common.files import ids_sha256
from common.ids import prompt_id as mint_prompt_id
from store.token_ids import read_ids_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BUILTIN = CONFIGS / "corpus" / "builtin.yaml"
# `imatrix: {corpus: builtin}`: a calibration text written for logit-matrix (CC0) that shares no
# passage with the evaluation corpus (matrix/spec/calibration.py checks it like any other text)
BUILTIN_CALIBRATION = CONFIGS / "corpus" / "calibration.txt"
ENTRY_KEYS = {"id", "category", "source", "text", "file", "chat", "ids", "ids_file", "chunks", "max_chunks", "vocab"}
BODIES = ("text", "file", "chat", "ids", "ids_file")
CATEGORIES = ("cold_start", "long_context", "chat_tool_call", "reasoning", "code", "other")


@dataclass(frozen=True)
class Entry:
    id: str
    category: str
    source: str
    text: str | None
    chat: list[dict] | None
    ids: list[tuple[str, list[int]]] | None = None  # (name suffix, ids) per prompt, for ids / ids_file
    chunks: int | None = None  # n_ctx: cut like llama-perplexity
    max_chunks: int | None = None  # only the first max_chunks chunks (None: every chunk)
    vocab: Path | None = None  # a GGUF whose llama.cpp tokenizer tokenises the text
    ids_kind: str | None = None  # inline | npy | parquet | kld-base

    @property
    def source_sha256(self) -> str | None:
        """sha256 of the text the entry's prompts come from: a text's (a file's) UTF-8 bytes, as
        sha256sum gives a file read as it is; a chat's JSON; token ids' JSON."""
        if self.text is not None:
            return hashlib.sha256(self.text.encode("utf-8")).hexdigest()
        body = self.chat if self.chat is not None else self.ids
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    model: str
    corpus: str
    name: str
    category: str
    source: str
    text: str | None  # None for ids and chunk prompts: there is no text an engine could re-tokenise
    token_ids: list[int]
    ids_sha256: str
    bos_policy: str
    bos_added: bool
    starts_with_bos: bool
    tokenizer_sha256: str | None
    source_sha256: str | None = None  # Entry.source_sha256: the text it comes from

    def to_row(self) -> dict:
        return asdict(self)


def corpus_path(corpus: str) -> Path:
    return BUILTIN if corpus == "builtin" else Path(corpus)


def _load_yaml(path: Path) -> dict:
    data = read_yaml_file(path, "corpus file")
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not data["prompts"]:
        raise UserError(f"{path}: prompts: a corpus needs a non-empty 'prompts' list")
    unknown = set(data) - {"name", "prompts", "description"}
    if unknown:
        raise UserError(f"{path}: {sorted(unknown)[0]}: unknown key; expected name, description, prompts")
    return data


def corpus_files(corpus: str) -> list[Path]:
    """The corpus YAML and every file it references (for fingerprints)."""
    path = corpus_path(corpus)
    data = _load_yaml(path)
    files = [path]
    for i, e in enumerate(data["prompts"]):
        for key in ("file", "ids_file", "vocab"):
            if isinstance(e, dict) and key in e:
                f = path.parent / str(e[key])
                if not f.is_file():
                    raise UserError(f"{path}: prompts[{i}].{key}: file not found ({f})")
                files.append(f)
    return files


def _body(path: Path, fld: str, i: int, e: dict) -> dict:
    """The entry's one body, read and checked -> Entry fields."""
    bodies = [k for k in BODIES if k in e]
    if len(bodies) != 1:
        raise UserError(f"{fld}: needs exactly one of {', '.join(BODIES)} (got {bodies or 'none'})")
    kind = bodies[0]
    if kind == "text":
        if not isinstance(e["text"], str) or not e["text"]:
            raise UserError(f"{fld}.text: must be a non-empty string")
        return {"text": e["text"]}
    if kind == "file":
        f = path.parent / str(e["file"])
        if not f.is_file():
            raise UserError(f"{fld}.file: file not found ({f})")
        return {"text": read_text_file(f, f"the file of prompts[{i}] in {path}")}
    if kind == "chat":
        chat = e["chat"]
        if (
            not isinstance(chat, list)
            or not chat
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in chat
            )
        ):
            raise UserError(f"{fld}.chat: must be a list of {{role, content}} messages")
        return {"chat": chat}
    if kind == "ids":
        v = e["ids"]
        if (
            not isinstance(v, list)
            or not v
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)
        ):
            raise UserError(f"{fld}.ids: must be a non-empty list of token ids >= 0 (got {str(v)[:80]})")
        return {"ids": [("", v)], "ids_kind": "inline"}
    kind, rows = read_ids_file(path.parent / str(e["ids_file"]))
    return {"ids": rows, "ids_kind": kind}


def _options(path: Path, fld: str, e: dict, body: dict) -> dict:
    out = {}
    if "chunks" in e:
        n = e["chunks"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise UserError(f"{fld}.chunks: must be a context length >= 2 (got {n!r})")
        if "chat" in body or body.get("ids_kind") == "kld-base" or len(body.get("ids") or [1]) != 1:
            raise UserError(f"{fld}.chunks: only a text, a file or one sequence of ids can be cut into chunks")
        out["chunks"] = n
    if "max_chunks" in e:
        n = e["max_chunks"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"{fld}.max_chunks: must be a number of chunks >= 1 (got {n!r})")
        if "chunks" not in e:
            raise UserError(f"{fld}.max_chunks: only a text cut into chunks (chunks: N_CTX) takes it (got {n!r})")
        out["max_chunks"] = n
    if "vocab" in e:
        f = path.parent / str(e["vocab"])
        if not f.is_file():
            raise UserError(f"{fld}.vocab: file not found ({f})")
        if body.get("text") is None:
            raise UserError(f"{fld}.vocab: only a text or a file is tokenised (got {e['vocab']!r} on another body)")
        out["vocab"] = f
    return out


def load_entries(corpus: str) -> tuple[str, list[Entry]]:
    path = corpus_path(corpus)
    data = _load_yaml(path)
    name = str(data.get("name") or path.stem)
    entries, ids = [], set()
    for i, e in enumerate(data["prompts"]):
        fld = f"{path}: prompts[{i}]"
        if not isinstance(e, dict):
            raise UserError(f"{fld}: must be a mapping (got {e!r})")
        unknown = set(e) - ENTRY_KEYS
        if unknown:
            raise UserError(f"{fld}.{sorted(unknown)[0]}: unknown key; expected one of {', '.join(sorted(ENTRY_KEYS))}")
        pid = e.get("id")
        if not isinstance(pid, str) or not pid or pid in ids:
            raise UserError(f"{fld}.id: needs a unique non-empty id (got {pid!r})")
        ids.add(pid)
        cat = e.get("category", "other")
        if cat not in CATEGORIES:
            raise UserError(f"{fld}.category: expected one of {', '.join(CATEGORIES)} (got {cat!r})")
        body = _body(path, fld, i, e)
        entries.append(
            Entry(
                pid,
                cat,
                str(e.get("source", "")),
                body.get("text"),
                body.get("chat"),
                body.get("ids"),
                ids_kind=body.get("ids_kind"),
                **_options(path, fld, e, body),
            )
        )
    return name, entries


def chunk_ids(tokens: list[int], n_ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks (tools/perplexity/perplexity.cpp): n_chunk = len // n_ctx, or
    min(limit, that) as its --chunks takes; chunk i = tokens[i*n_ctx : (i+1)*n_ctx], its first token
    replaced by bos (None: kept) as it evaluates it."""
    n_chunk = len(tokens) // n_ctx
    out = []
    for c in range(n_chunk if limit is None else min(limit, n_chunk)):
        chunk = list(tokens[c * n_ctx : (c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def _text_ids(e: Entry, text: str, tokenizer, bos_policy: str, model: str) -> tuple[list[int], bool, int | None]:
    """-> (ids, whether a BOS was added, the BOS a chunk starts with or None)."""
    bos = tokenizer.bos_token_id
    if e.vocab is not None:  # llama.cpp's tokenizer: BOS where the GGUF asks for it, as llama-perplexity
        ids, gguf_bos = backends.for_files(GGUF).file_tokenize(str(e.vocab), text)
        if bos_policy == "never" and gguf_bos is not None and ids[:1] == [gguf_bos]:
            return ids[1:], False, None
        if bos_policy == "always" and gguf_bos is None:
            raise UserError(f"{model}: bos: always, but {e.vocab} says its model takes no BOS")
        return ids, gguf_bos is not None and ids[:1] == [gguf_bos], gguf_bos
    plain = list(tokenizer(text, add_special_tokens=False).input_ids)
    if bos_policy == "tokenizer":
        ids = list(tokenizer(text, add_special_tokens=True).input_ids)
        added = len(ids) > len(plain) and bos is not None and ids[0] == bos
        return ids, added, bos if added else None
    if bos_policy == "always":
        if bos is None:
            raise UserError(f"{model}: bos: always, but the tokenizer has no BOS token")
        added = not (plain and plain[0] == bos)
        return ([bos] if added else []) + plain, added, bos
    return plain, False, None


def _sequences(e: Entry, tokenizer, bos_policy: str, model: str, where: str):
    """-> [(name, text or None, ids, bos added)] for one entry."""
    if e.ids is not None:
        n_vocab = len(tokenizer)
        for _sub, ids in e.ids:
            bad = next((v for v in ids if v >= n_vocab), None)
            if bad is not None:
                raise UserError(
                    f"{where}: prompts {e.id}: token id {bad} is outside the vocabulary of {model} (0..{n_vocab - 1})"
                )
        if e.ids_kind == "kld-base":  # llama-perplexity put BOS in each chunk's place where the model takes it
            bos = _chunk_bos(tokenizer, bos_policy)
            return [(f"{e.id}-{sub}", None, chunk_ids(ids, len(ids), bos)[0], bos is not None) for sub, ids in e.ids]
        if e.chunks is None:
            return [(f"{e.id}-{sub}" if sub else e.id, None, ids, False) for sub, ids in e.ids]
        return [
            (f"{e.id}-c{c}", None, ch, False)
            for c, ch in enumerate(chunk_ids(e.ids[0][1], e.chunks, None, e.max_chunks))
        ]
    if e.chat is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{model}: prompt {e.id} is a chat but the tokenizer has no chat template")
        text = tokenizer.apply_chat_template(e.chat, tokenize=False)
    else:
        text = e.text
    ids, added, bos = _text_ids(e, text, tokenizer, bos_policy, model)
    if e.chunks is None:
        return [(e.id, text, ids, added)]
    chunks = chunk_ids(ids, e.chunks, bos, e.max_chunks)
    if not chunks:
        raise UserError(f"{where}: prompts {e.id}: chunks: {e.chunks}, but the text is only {len(ids)} tokens")
    return [(f"{e.id}-c{c}", None, ch, bos is not None) for c, ch in enumerate(chunks)]


def _chunk_bos(tokenizer, bos_policy: str) -> int | None:
    if bos_policy == "never" or tokenizer.bos_token_id is None:
        return None
    if bos_policy == "always":
        return tokenizer.bos_token_id
    probe = list(tokenizer("a", add_special_tokens=True).input_ids)
    return tokenizer.bos_token_id if probe[:1] == [tokenizer.bos_token_id] else None


def tokenize(
    corpus: str,
    model: str,
    tokenizer,
    bos_policy: str,
    tokenizer_sha256: str | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> list[Prompt]:
    """Render and tokenise every entry once (ids entries are taken as they are).

    bos_policy: ``tokenizer`` (whatever the tokenizer adds by default),
    ``always`` (prepend BOS unless the text already starts with it: a chat
    template may emit it, and a double BOS shifts every logit), ``never``.
    """
    name, entries = load_entries(corpus)
    bos = tokenizer.bos_token_id
    prompts = []
    for e in entries:
        if e.chat is not None and not getattr(tokenizer, "chat_template", None):
            # a base model (Gemma 3 270M's GGUF carries no template): its chats have no rendering
            log(f"{model}: prompt {e.id} is a chat and the tokenizer has no chat template: left out for this model")
            continue
        source_sha256 = e.source_sha256  # once per entry: a text cut into chunks is hashed whole
        for pname, text, ids, added in _sequences(e, tokenizer, bos_policy, model, str(corpus_path(corpus))):
            if not ids:
                raise UserError(f"{model}: prompt {pname} tokenises to no tokens")
            h = ids_sha256(ids)
            prompts.append(
                Prompt(
                    prompt_id=mint_prompt_id(pname, h),
                    model=model,
                    corpus=name,
                    name=pname,
                    category=e.category,
                    source=e.source,
                    text=text,
                    token_ids=[int(i) for i in ids],
                    ids_sha256=h,
                    bos_policy=bos_policy if e.ids is None or e.ids_kind == "kld-base" else "ids",
                    bos_added=bool(added),
                    starts_with_bos=bos is not None and ids[0] == bos,
                    tokenizer_sha256=tokenizer_sha256 if e.ids is None and e.vocab is None else None,
                    source_sha256=source_sha256,
                )
            )
    if not prompts:
        raise UserError(f"{model}: no prompt of corpus {name} can be rendered for this model")
    return prompts
