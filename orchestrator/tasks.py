"""Tasks started and not awaited (a channel closed in the background): the event loop keeps
only a weak reference to a task, so one that nobody holds may be collected before it ends."""

import asyncio

_running: set[asyncio.Task] = set()


def spawn(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


def cancelling() -> bool:
    """Whether the running task was asked to cancel. grpc's asyncio calls answer that cancel
    with a CANCELLED error: code that catches a call's errors asks this first."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0  # Python 3.11 on
