"""asyncio helpers shared by the gateway and the worker agent."""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` up to ``seconds``; True if set. (``asyncio.timeout``, not
    ``wait_for``: on Python 3.11 ``wait_for`` can swallow a cancellation that races its
    timeout, and a loop that swallows its cancellation never stops.)"""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
        return True
    except TimeoutError:
        return False
