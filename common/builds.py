"""Which build of an engine a node has: the part of "already captured" that the spec cannot see.

A build is each library the backend names (Backend.libraries) with its version and a digest of
the files its installer recorded (the wheel's RECORD: one sha256 per file). A llama-cpp-python
compiled with other flags, a torch of another CUDA, a vLLM of another commit: same version,
other file hashes, other build. The same wheel installed in two places is one build, so the
digest leaves out what differs by install location: scripts outside site-packages (their
shebang names the interpreter) and the .dist-info bookkeeping (INSTALLER, direct_url.json).
An edit made in place after installing is not seen: RECORD still says what was installed.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata


def _files_digest(dist: metadata.Distribution) -> str | None:
    """sha256 over the sorted `path,hash` lines of the package's own files; None without RECORD."""
    text = dist.read_text("RECORD")
    if text is None:  # not installed from a wheel (e.g. some conda packages): the version only
        return None
    lines = []
    for line in text.splitlines():
        path, _, rest = line.partition(",")
        file_hash = rest.partition(",")[0]
        top = path.split("/", 1)[0]
        if not file_hash or path.startswith("../") or top.endswith((".dist-info", ".data")):
            continue
        lines.append(f"{path},{file_hash}")
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:16]


def library_build(name: str) -> dict:
    """{"version", "files"} of one installed distribution; both None when it is not installed."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return {"version": None, "files": None}
    return {"version": dist.version, "files": _files_digest(dist)}


def engine_build(libraries: tuple[str, ...] | list[str]) -> dict:
    """{"build": 12 hex, "libraries": {name: {version, files}}, "cpu_flags": [...]} for this
    interpreter; the CPU's flags ride along (not in the build's hash) so that the run places a
    cell's CPU code path only on a node that executes it (extras: Extra.node_refusal)."""
    from common.cpu_paths import cpu_flags

    libs = {name: library_build(name) for name in sorted(libraries)}
    digest = hashlib.sha256(json.dumps(libs, sort_keys=True).encode()).hexdigest()[:12]
    return {"build": digest, "libraries": libs, "cpu_flags": sorted(cpu_flags())}


def describe(libraries: dict) -> str:
    """One short line: `torch 2.13.0+cpu, transformers 4.57.1` (not installed: `-`)."""
    return ", ".join(f"{k} {v['version'] or '-'}" for k, v in sorted(libraries.items()))
