"""``launch_dht_instances``, as hivemind's tests/test_averaging.py calls it (this project's own version)."""

from __future__ import annotations

from typing import Any

from hivemind import DHT


def launch_dht_instances(n_peers: int, **kwargs: Any) -> list[DHT]:
    """``n_peers`` running DHTs on this machine: the first one alone, every other one started from its
    addresses; returns once all of them are ready. ``kwargs`` go to every ``DHT``."""
    first = DHT(start=True, **kwargs)
    others = [
        DHT(initial_peers=first.get_visible_maddrs(), start=True, await_ready=False, **kwargs)
        for _ in range(n_peers - 1)
    ]
    for dht in others:
        dht.wait_until_ready()
    return [first, *others]
