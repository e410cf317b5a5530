"""Ports picked now for a server that binds them later (Serve's proxy, Ray's metrics exporter, the
test and benchmark servers).

Between the pick and the bind another process may take the port. A port the kernel hands out for
bind(0) or an outgoing connection comes from Linux's ephemeral range (ip_local_port_range,
32768-60999 by default), where Ray's own gRPC servers and every client connection take theirs; so
ports are picked below it and above Ray's worker ports (10002-19999), at random, and checked free."""

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_ATTEMPTS = 1000
_handed_out: set[int] = set()  # this process's picks: a pick not bound yet is still free


def _picking_range() -> range:
    """Ports from RAY_WORKER_PORTS_END to the ephemeral range's start (32768 where it is not read)."""
    try:
        start = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return range(RAY_WORKER_PORTS_END, max(start, RAY_WORKER_PORTS_END + 1024))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on host now, outside the ranges the kernel and Ray hand out, and
    not handed out before by this process."""
    ports = _picking_range()
    for _ in range(PICK_ATTEMPTS):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port on {host} in {ports.start}-{ports.stop - 1} after {PICK_ATTEMPTS} tries")
