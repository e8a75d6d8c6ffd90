"""A process-wide change to hivemind: attributes of hivemind's classes or modules replaced, and put back.

Each patch module builds its replacements in a function that returns ``(owner, attribute, new value)``
triples; :class:`Patch` installs them (keeping what was there) and uninstalls them. An averager process is
forked with the classes as they are when it starts, so install before building the averagers, and a test
that uninstalls gets plain hivemind in the averagers it builds afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class Patch:
    """One named process-wide change; ``targets()`` returns the ``(owner, attribute, value)`` triples."""

    def __init__(self, name: str, targets: Callable[[], list[tuple[Any, str, Any]]]) -> None:
        self.name, self._targets = name, targets
        self._saved: list[tuple[Any, str, Any]] | None = None

    @property
    def installed(self) -> bool:
        return self._saved is not None

    def install(self) -> None:
        """Replace the attributes; idempotent."""
        if self._saved is not None:
            return
        targets = self._targets()
        self._saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in targets]
        for owner, name, value in targets:
            setattr(owner, name, value)

    def uninstall(self) -> None:
        """Put hivemind's own attributes back; idempotent."""
        if self._saved is None:
            return
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved = None

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, installed={self.installed})"
