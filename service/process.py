"""What a serving process holds, for soak tests and debugging: memory, descriptors, tasks."""

import asyncio
import os
import resource


def process_stats() -> dict[str, int]:
    """This process's id, resident memory (bytes), open file descriptors and, when called from
    an event loop, its asyncio tasks (Linux: read from /proc)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running event loop
        tasks = 0
    return {
        "pid": os.getpid(),
        "rss_bytes": resident_pages * resource.getpagesize(),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "asyncio_tasks": tasks,
    }
