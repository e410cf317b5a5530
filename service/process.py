"""What a serving process holds, for soak tests and debugging: memory, descriptors, tasks."""

import asyncio

import psutil


def process_stats(pid: int | None = None) -> dict[str, int]:
    """A process's id, resident memory (bytes), open file descriptors and asyncio tasks: this
    process's (pid None; its tasks when called from an event loop), or another's (no tasks)."""
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
    }
