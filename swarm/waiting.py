"""One way to wait for a condition, instead of a hand-written deadline loop in every module and test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.2) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy or ``timeout`` seconds
    have passed; returns its last value (falsy on a timeout, so that the caller's assert names what failed).
    An exception from ``condition`` ends the wait at once (a peer that exited, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        left = deadline - time.monotonic()
        if value or left <= 0:
            return value
        time.sleep(min(interval, left))
