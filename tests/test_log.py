"""The one log format's guard against shutdown noise from multiprocessing's resource-sharer thread."""

from __future__ import annotations

import multiprocessing.resource_sharer as resource_sharer
import sys

from swarm.log import _quiet_resource_sharer


def _raise_in(filename: str, exc: BaseException):
    """Raise ``exc`` from a frame whose file name is ``filename`` (as the sharer's thread would)."""
    code = compile("def fail(exc):\n    raise exc\n", filename, "exec")
    namespace: dict = {}
    exec(code, namespace)
    try:
        namespace["fail"](exc)
    except BaseException:
        return sys.exc_info()


def test_resource_sharer_resets_are_quiet_and_everything_else_is_not():
    seen = []
    hook = _quiet_resource_sharer(lambda *info: seen.append(info[0]))
    hook(*_raise_in(resource_sharer.__file__, ConnectionResetError(104, "Connection reset by peer")))
    hook(*_raise_in(resource_sharer.__file__, EOFError()))
    assert seen == [], "a helper that left mid-handshake is not an error the user must see"
    hook(*_raise_in(__file__, ConnectionResetError(104, "reset elsewhere")))
    hook(*_raise_in(resource_sharer.__file__, ValueError("a real bug")))
    assert seen == [ConnectionResetError, ValueError]
