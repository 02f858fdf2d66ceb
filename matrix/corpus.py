"""Corpus loading and the one tokenisation every stack shares.

Texts are tokenised once, by the reference tokenizer of each model, under an
explicit BOS policy; the resulting ids (not the text) go to every stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import UserError, read_text_file, read_yaml_file
from common.files import ids_sha256
from common.ids import prompt_id as mint_prompt_id

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BUILTIN = CONFIGS / "corpus" / "builtin.yaml"
ENTRY_KEYS = {"id", "category", "source", "text", "file", "chat"}
CATEGORIES = ("cold_start", "long_context", "chat_tool_call", "reasoning", "code", "other")


@dataclass(frozen=True)
class Entry:
    id: str
    category: str
    source: str
    text: str | None
    chat: list[dict] | None


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    model: str
    corpus: str
    name: str
    category: str
    source: str
    text: str
    token_ids: list[int]
    ids_sha256: str
    bos_policy: str
    bos_added: bool
    starts_with_bos: bool
    tokenizer_sha256: str | None

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
        if isinstance(e, dict) and "file" in e:
            f = path.parent / str(e["file"])
            if not f.is_file():
                raise UserError(f"{path}: prompts[{i}].file: file not found ({f})")
            files.append(f)
    return files


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
        bodies = [k for k in ("text", "file", "chat") if k in e]
        if len(bodies) != 1:
            raise UserError(f"{fld}: needs exactly one of text, file, chat (got {bodies or 'none'})")
        text, chat = None, None
        if "text" in e:
            text = e["text"]
            if not isinstance(text, str) or not text:
                raise UserError(f"{fld}.text: must be a non-empty string")
        elif "file" in e:
            f = path.parent / str(e["file"])
            if not f.is_file():
                raise UserError(f"{fld}.file: file not found ({f})")
            text = read_text_file(f, f"the file of prompts[{i}] in {path}")
        else:
            chat = e["chat"]
            if not isinstance(chat, list) or not chat or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in chat):
                raise UserError(f"{fld}.chat: must be a list of {{role, content}} messages")
        entries.append(Entry(pid, cat, str(e.get("source", "")), text, chat))
    return name, entries



def tokenize(corpus: str, model: str, tokenizer, bos_policy: str,
             tokenizer_sha256: str | None = None) -> list[Prompt]:
    """Render and tokenise every entry once.

    bos_policy: ``tokenizer`` (whatever the tokenizer adds by default),
    ``always`` (prepend BOS unless the text already starts with it: a chat
    template may emit it, and a double BOS shifts every logit), ``never``.
    """
    name, entries = load_entries(corpus)
    bos = tokenizer.bos_token_id
    prompts = []
    for e in entries:
        if e.chat is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(f"{model}: prompt {e.id} is a chat but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template(e.chat, tokenize=False)
        else:
            text = e.text
        plain = list(tokenizer(text, add_special_tokens=False).input_ids)
        if bos_policy == "tokenizer":
            ids = list(tokenizer(text, add_special_tokens=True).input_ids)
            added = len(ids) > len(plain) and bos is not None and ids[0] == bos
        elif bos_policy == "always":
            if bos is None:
                raise UserError(f"{model}: bos: always, but the tokenizer has no BOS token")
            added = not (plain and plain[0] == bos)
            ids = ([bos] if added else []) + plain
        else:
            ids, added = plain, False
        if not ids:
            raise UserError(f"{model}: prompt {e.id} tokenises to no tokens")
        h = ids_sha256(ids)
        prompts.append(Prompt(
            prompt_id=mint_prompt_id(e.id, h), model=model, corpus=name, name=e.id, category=e.category,
            source=e.source, text=text, token_ids=[int(i) for i in ids], ids_sha256=h,
            bos_policy=bos_policy, bos_added=bool(added), starts_with_bos=bos is not None and ids[0] == bos,
            tokenizer_sha256=tokenizer_sha256))
    return prompts
