"""What a serving process holds, for soak tests and debugging: memory, descriptors, tasks."""

import asyncio
import os

import psutil


def process_stats() -> dict[str, int]:
    """This process's id, resident memory (bytes), open file descriptors and, when called from
    an event loop, its asyncio tasks."""
    process = psutil.Process()
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running event loop
        tasks = 0
    return {
        "pid": os.getpid(),
        "rss_bytes": process.memory_info().rss,
        "open_fds": process.num_fds(),
        "asyncio_tasks": tasks,
    }
