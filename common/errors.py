"""Errors the CLI turns into one line on stderr and exit code 2."""

import os
import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def first_line(text: str, default: str = "") -> str:
    """The first non-blank line of an error message, without ANSI colour codes (at most 500 chars)."""
    for line in ANSI.sub("", text).splitlines():
        if line.strip():
            return line.strip()[:500]
    return default


class UserError(Exception):
    """Bad input (spec, corpus, model path, warehouse). The message is the whole report."""


class OracleError(UserError):
    """A stack's weights were not all loaded from the checkpoint (a silently random-initialised
    oracle makes every comparison meaningless; e.g. huggingface/transformers#47407)."""


def read_text_file(path, what: str = "file") -> str:
    """A UTF-8 text file's contents; any other encoding is a UserError naming the file and the byte."""
    from pathlib import Path

    try:
        data = Path(path).read_bytes()
    except OSError as e:  # not there, not a file, not readable: one line, exit 2
        raise UserError(f"{path}: {what} cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path}: {what} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
            f"(line {line}); save it as UTF-8"
        ) from None


def read_yaml_file(path, what: str):
    """Parse a YAML file; a missing file or malformed YAML is a UserError naming the file (and line)."""
    from pathlib import Path

    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: {what} not found")
    try:
        return yaml.safe_load(read_text_file(p, what))
    except yaml.YAMLError as e:
        raise UserError(f"{p}: malformed YAML: {str(e).splitlines()[0]}") from None


SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECURITY_TOKEN",
    "CLOUDSDK_AUTH_ACCESS_TOKEN",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
# the secret fields of a Google credentials file (service account, authorized user, external account)
SECRET_FIELDS = ("private_key", "private_key_id", "client_secret", "refresh_token", "access_token")


def _secrets() -> list[str]:
    out = [os.environ.get(name, "") for name in SECRET_ENV]
    adc = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if adc:
        import json

        try:
            with open(adc, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}  # Google's client reports an unreadable file itself; nothing of ours to hide
        if isinstance(doc, dict):
            out += [str(doc.get(k, "")) for k in SECRET_FIELDS]
    return [v for v in out if len(v) >= 4]


def redact(text: str) -> str:
    """text with every credential this process holds replaced by ***."""
    for value in _secrets():
        text = text.replace(value, "***")
    return text
