"""service.ports.free_port: ports outside the ranges the kernel and Ray hand out, free when picked."""

import socket
from pathlib import Path

import pytest

from service import ports


def test_a_picked_port_is_free_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = ports.free_port()
        assert ports.RAY_WORKER_PORTS_END <= port < max(low, ports.RAY_WORKER_PORTS_END + 1024)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_port_in_use_or_handed_out_before_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        used = taken.getsockname()[1]
        with socket.socket() as first, socket.socket() as second:  # two ports free now, for the later picks
            first.bind(("127.0.0.1", 0))
            second.bind(("127.0.0.1", 0))
            a, b = first.getsockname()[1], second.getsockname()[1]
        picks = iter([used, used, a, a, used, b])
        monkeypatch.setattr(ports.random, "choice", lambda _: next(picks))
        assert ports.free_port() == a
        assert ports.free_port() == b  # a again, then the port in use, passed over


def test_no_free_port_raises_naming_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(ports.random, "choice", lambda _: taken.getsockname()[1])
        with pytest.raises(OSError, match=r"no free port on 127\.0\.0\.1 in 20000-"):
            ports.free_port()


def test_the_range_ends_where_the_machines_ephemeral_range_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", setting)
    assert ports._picking_range() == range(20000, 40000)
    setting.write_text("20100\t60999\n")  # a range starting low: still 1,024 ports to pick from
    assert ports._picking_range() == range(20000, 21024)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ports._picking_range() == range(20000, 32768)
