"""The driver's Ray connection: join a cluster (checked reachable first) or start a local one.

Only the CLI calls init_ray, and only the CLI shuts Ray down: library code never does.
"""

from __future__ import annotations

import os
import socket

from common.errors import UserError


def _check_reachable(address: str, timeout: float = 5.0) -> None:
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


def init_ray(address: str | None):
    """Connect to a cluster or start a local one. Only the CLI calls this (and shutdown)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 defaults to token auth
    import ray

    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"--address {address}: {str(e).splitlines()[0]}") from None
    else:
        # address "local": a new cluster of our own, even when `ray start` left one on this machine
        # (ray.init() would join that one, with whatever nodes and settings it has)
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    return ray
