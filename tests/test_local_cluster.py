"""loadtests.cluster.local_cluster starts a cluster anew when a `ray start` ended before its node
came up (Ray gives a raylet a fixed 30 s to register), and gives up after START_ATTEMPTS."""

from pathlib import Path
from typing import Any

import pytest

from loadtests import cluster


class Started:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def failing_first(failures: int, calls: list[Path]) -> Any:
    def start(directory: Path, **options: Any) -> Started:
        calls.append(directory)
        if len(calls) <= failures:
            raise cluster.RayStartError("`ray start` exited while waiting for the head node")
        return Started()

    return start


def test_a_cluster_whose_ray_start_exited_is_started_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(cluster, "start_cluster", failing_first(cluster.START_ATTEMPTS - 1, calls))
    with cluster.local_cluster(tmp_path) as started:
        assert isinstance(started, Started) and not started.stopped
    assert started.stopped and calls == [tmp_path] * cluster.START_ATTEMPTS


def test_it_gives_up_after_start_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(cluster, "start_cluster", failing_first(cluster.START_ATTEMPTS, calls))
    with pytest.raises(cluster.RayStartError), cluster.local_cluster(tmp_path):
        pass
    assert len(calls) == cluster.START_ATTEMPTS
