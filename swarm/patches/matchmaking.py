"""Matchmaking (hivemind/averaging/matchmaking.py): when a group closes, and how often a waiting peer reads.

**What hivemind does.** A leader accepts followers until its group reaches ``target_group_size`` or its
declared expiration (``matchmaking_time`` after it began looking) passes (``Matchmaking.rpc_join_group``,
matchmaking.py:262-330). That size is fixed when the averager process starts. While a peer looks for a group,
``PotentialLeaders.pop_next_leader`` (matchmaking.py:469-498) asks for a new read of the declared averagers
whenever its queue holds no leader to try, and ``_update_queue_periodically`` (matchmaking.py:500-522) reads
again as soon as it is asked.

**What goes wrong.** A swarm whose size changes cannot name one fixed target size, so every round waits the
whole ``matchmaking_time`` (item 1 of docs/hivemind-patches.md). And a waiting peer reads the DHT back to
back, each read a request through the DHT process and the p2p daemon to every node, taking CPU from the
groupmate that is still computing, the one being waited for (item 20).

**What this changes.** :func:`set_target_group_size` sets the size in the running averager process (through
hivemind's own control pipe, ``_outer_pipe``), so the strategy keeps it equal to the number of peers the
progress tracker sees. :func:`install` runs hivemind's own ``_update_queue_periodically`` on a key manager
whose reads come at least ``LEADER_READS_EVERY`` apart (:class:`PacedReads`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from swarm.patches._registry import Patch

LEADER_READS_EVERY = 0.025  # item 20: seconds between two reads of the declared averagers, at least
_CONTROL = "_swarm_set_target_group_size"  # the averager's method that the control pipe calls


async def _set_target_group_size_here(self: Any, size: int | None) -> None:
    """Runs inside the averager process (sent over hivemind's control pipe)."""
    matchmaking = getattr(self, "_matchmaking", None)
    if matchmaking is not None:
        # the key manager keeps its own copy, used to pick group bits; left alone, since a follower of a
        # larger group than its own target would fail there (and the swarm uses no group bits)
        matchmaking.target_group_size = size


def set_target_group_size(averager: Any, size: int | None, sent: dict[int, int | None]) -> None:
    """Make ``averager``'s matchmaking close a group once it has ``size`` peers (None: wait the whole
    matchmaking time). ``sent`` (the caller's, by ``id(averager)``) remembers the last size sent, so a call
    that changes nothing costs nothing; a no-op once the averager process is gone. Needs :func:`install`."""
    if sent.get(id(averager), "unset") == size or not averager.is_alive():
        return
    sent[id(averager)] = size
    averager._outer_pipe.send((_CONTROL, [size], {}))


class PacedReads:
    """A ``GroupKeyManager`` whose ``get_averagers`` waits until ``LEADER_READS_EVERY`` after its last read,
    though never past the search's end (``leaders.search_end_time``); everything else is the key manager's."""

    def __init__(self, key_manager: Any, leaders: Any) -> None:
        self._key_manager, self._leaders = key_manager, leaders
        self._last_read = -float("inf")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key_manager, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        from hivemind.utils import get_dht_time

        pause = self._last_read + LEADER_READS_EVERY - get_dht_time()
        if pause > 0:
            await asyncio.sleep(min(pause, max(0.0, self._leaders.search_end_time - get_dht_time())))
        self._last_read = get_dht_time()
        return await self._key_manager.get_averagers(*args, **kwargs)


def _targets() -> list[tuple[Any, str, Any]]:
    from hivemind.averaging import matchmaking
    from hivemind.averaging.averager import DecentralizedAverager

    original = matchmaking.PotentialLeaders._update_queue_periodically

    async def _update_queue_at_most_every(self: Any, key_manager: Any) -> None:
        """hivemind's ``PotentialLeaders._update_queue_periodically`` itself, on paced reads (item 20). Runs
        in the averager process."""
        await original(self, PacedReads(key_manager, self))

    return [
        (DecentralizedAverager, _CONTROL, _set_target_group_size_here),
        (matchmaking.PotentialLeaders, "_update_queue_periodically", _update_queue_at_most_every),
    ]


PATCH = Patch("matchmaking", _targets)
