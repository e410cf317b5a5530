"""What a serving process holds, for soak tests and debugging: memory, descriptors, tasks; and
its CPU priority beside the engine's process."""

import asyncio
import os

import psutil


def process_stats(pid: int | None = None) -> dict[str, int]:
    """A process's id, resident memory (bytes), open file descriptors, asyncio tasks and nice value
    (its main thread's): this process's (pid None; its tasks when called from an event loop), or
    another's (no tasks)."""
    process = psutil.Process(pid)
    try:
        tasks = len(asyncio.all_tasks()) if pid is None else 0
    except RuntimeError:  # no running event loop
        tasks = 0
    return {
        "pid": process.pid,
        "rss_bytes": process.memory_info().rss,
        "open_fds": process.num_fds(),
        "asyncio_tasks": tasks,
        "nice": process.nice(),
    }


def lower_priority(niceness: int) -> None:
    """Runs every thread of this process at nice value `niceness` at least (Linux's nice is a
    thread's: each is set, and threads started later inherit their creator's). A Serve replica
    calls it once its engine's process has started (at the priority it had): on a CPU the engine's
    step, the work every stream waits for, then gets the core when the replica's streaming and
    the engine contend for it. 0: unchanged; a no-op where threads are not listed in /proc."""
    if niceness <= 0 or not os.path.isdir("/proc/self/task"):
        return
    for thread in os.listdir("/proc/self/task"):
        try:
            tid = int(thread)
            os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
