"""service/process.py lower_priority: a replica's threads run below its engine's process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, os, subprocess, sys, threading
from service.process import lower_priority
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)  # until told
lower_priority(int(sys.argv[1]))
lower_priority(int(sys.argv[2]))  # a second call never raises the priority back
after = threading.Thread(target=stop.wait)
after.start()
threads = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")]
print(json.dumps({"threads": threads, "child": os.getpriority(os.PRIO_PROCESS, child.pid)}))
child.communicate()  # its stdin closed: it ends
stop.set()
"""


def priorities(first: int, second: int) -> dict[str, list[int] | int]:
    """The nice values of every thread of a process that called lower_priority(first), then
    (second), with a thread started before and one after, and of a child it started before."""
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(first), str(second)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    result: dict[str, list[int] | int] = json.loads(run.stdout)
    return result


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed in /proc on Linux only")
def test_every_thread_runs_lower_and_a_child_started_before_keeps_its_priority() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)  # what the script's process starts with
    lowered = priorities(10, 5)
    assert lowered["child"] == own
    threads = lowered["threads"]
    assert isinstance(threads, list) and len(threads) >= 3  # main, started before, started after
    assert set(threads) == {max(10, own)}
    unchanged = priorities(0, 0)
    assert unchanged["threads"] == [own] * len(threads) and unchanged["child"] == own
