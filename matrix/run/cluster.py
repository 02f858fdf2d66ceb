"""The driver's Ray connection: join a cluster (checked reachable first) or start a local one.

matrix.api opens it (init_ray) and shuts down only what it opened (release): nothing below the API
does either, and a connection the caller already holds is used as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
from pathlib import Path

from common.errors import UserError
from common.files import cache_root


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with the address in the message, instead of Ray's long retry loop."""
    if address == "auto":
        return  # Ray looks for a local cluster and says clearly when there is none
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"--address {address}: cannot reach {host}:{port} ({e.strerror or e})") from None


def _token_file() -> Path:
    """This user's token for the local clusters matrix starts: made once, readable by its owner only."""
    path = cache_root() / "ray-auth-token"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.replace(path.with_suffix(".tmp"), path)
    return path


def _has_token() -> bool:
    """Whether Ray would find a token where it looks (env, token file, ~/.ray/auth_token)."""
    return bool(
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").is_file()
    )


def connected() -> bool:
    """Whether this process already holds a Ray connection (a caller's own: it is used as it is)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def release(owned: bool) -> None:
    """Shut down the connection a call of matrix.api opened (owned), never one its caller holds."""
    if owned and connected():
        sys.modules["ray"].shutdown()


@contextlib.contextmanager
def signals_restored():
    """A call of matrix.api turns SIGTERM into an interrupt while it runs (sigterm_interrupts); the
    caller's own handler is back when it returns."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def init_ray(address: str | None):
    """Connect to a cluster or start a local one; a connection this process already holds is used as
    it is. matrix.api calls this and shuts down what it opened (`release`); nothing below it does.

    Ray's ports listen on every interface, so neither kind is left without authentication:
    joining, token mode is on whenever a token is given (Ray's driver never turns it on by
    itself); a local cluster uses a token of this user's (_token_file) unless RAY_AUTH_MODE
    says otherwise (the tests and `make` set `disabled`)."""
    # before `import ray`: Ray reads its auth settings once, when it is imported
    if address and "RAY_AUTH_MODE" not in os.environ and _has_token():
        os.environ["RAY_AUTH_MODE"] = "token"
    if not address and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(_token_file()))
    import ray

    if ray.is_initialized():  # the caller's own connection (a notebook's, a second call's)
        return ray
    if address:
        check_reachable(address)
        try:
            # Ray's "Connecting to existing Ray cluster" INFO lines would break the one-line error rule
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            hint = (
                ""
                if os.environ.get("RAY_AUTH_MODE") == "token"
                else " (a cluster with token auth needs RAY_AUTH_MODE=token and its token: "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            )
            raise UserError(f"--address {address}: {str(e).splitlines()[0]}{hint}") from None
    else:
        # address "local": a new cluster of our own, even when `ray start` left one on this machine
        # (ray.init() would join that one, with whatever nodes and settings it has)
        ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    sigterm_interrupts()
    return ray


def sigterm_interrupts() -> None:
    """SIGTERM as an interrupt like Ctrl-C (ray.init makes it a bare sys.exit; Python's default ends
    the process without cleanup), so the run records itself as interrupted, frees its actors or
    workers and says how to resume."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
