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

A peer alone waits its whole step deadline: when no follower came by its declared expiration, a leader of a
group smaller than ``min_group_size`` declares itself again and goes on looking (``continue`` in
``_request_join_potential_leaders``, matchmaking.py:161-170) until ``look_for_group`` times out at the step's
deadline (matchmaking.py:126-128), ``averaging_timeout`` after the round began. A peer whose groupmates left
(a volunteer's Ctrl-C ends its p2p daemon with it, and a Colab session ends with SIGKILL) is still counted
by its progress tracker, whose records of them live ``metadata_expiration`` (60 s): it waits the whole
timeout before it steps alone (15 s in the demo's swarm of two), at every epoch until the records expire
(item 30).

**What this changes.** :func:`set_target_group_size` sets the size in the running averager process (through
hivemind's own control pipe, ``_outer_pipe``), so the strategy keeps it equal to the number of peers the
progress tracker sees. :func:`install` runs hivemind's own ``_update_queue_periodically`` on a key manager
whose reads come at least ``LEADER_READS_EVERY`` apart, and ``LEADER_READS_QUIET`` once no peer that
declares itself from then on can be its leader (:class:`PacedReads`). :func:`give_up_alone` makes an
averager end a search in which, for the last ``grace`` seconds, it read no other declared averager and no
follower came: its step fails with :class:`NobodyElseLooking` at the next declared expiration, not at the
deadline (item 30). A live groupmate declares itself as soon as it schedules its round, so one that still
computes is seen within the grace; the caller (swarm/patches/optimizer.py) then leaves the silent peers'
records out of its tracker's reads until they store a newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from hivemind.averaging.matchmaking import MatchmakingException

from swarm.patches._registry import Patch

LEADER_READS_EVERY = 0.025  # item 20: seconds between two reads of the declared averagers, at least
LEADER_READS_QUIET = 0.25  # the same, once no peer that declares itself from then on can be the leader
CLOCK_SKEW = 0.5  # seconds by which two peers' clocks may differ, allowed for in that judgement
_CONTROL = "_swarm_set_target_group_size"  # the averager's method that the control pipe calls
_ALONE = "_swarm_give_up_alone"  # the averager's method that the control pipe calls (item 30)


class NobodyElseLooking(MatchmakingException):
    """A step's search ended because no other averager was declared and no follower came for its grace."""


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


async def _give_up_alone_here(self: Any, grace: float | None) -> None:
    """Runs inside the averager process (sent over hivemind's control pipe)."""
    matchmaking = getattr(self, "_matchmaking", None)
    if matchmaking is not None:
        matchmaking.potential_leaders.swarm_alone = None if grace is None else (grace, matchmaking)


def give_up_alone(averager: Any, grace: float | None) -> None:
    """Make ``averager``'s steps fail with :class:`NobodyElseLooking` once a search has gone on for ``grace``
    seconds with no other averager declared and no follower (None: hivemind's wait until the deadline); a
    no-op once the averager process is gone. Needs :func:`install`."""
    if averager.is_alive():
        averager._outer_pipe.send((_ALONE, [grace], {}))


class PacedReads:
    """A ``GroupKeyManager`` whose ``get_averagers`` waits until ``LEADER_READS_EVERY`` after its last read,
    or ``LEADER_READS_QUIET`` once no averager that declares itself from now on can come before this one as a
    leader, though never past the search's end (``leaders.search_end_time``); everything else is the key
    manager's.

    A peer reads to find a leader that comes before it: an earlier declared expiration. One that declares
    itself from now on declares at least ``min_matchmaking_time`` from now
    (``_declare_averager_periodically``, matchmaking.py:528-531), so once now + ``min_matchmaking_time`` is
    past this peer's own declared expiration (less ``CLOCK_SKEW``), any newcomer finds this peer by its own
    first read and joins it: this peer has nothing new to learn from reading but for a newcomer whose clock
    runs behind, and reads slowly."""

    def __init__(self, key_manager: Any, leaders: Any) -> None:
        self._key_manager, self._leaders = key_manager, leaders
        self._last_read = -float("inf")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key_manager, name)

    def pause(self, now: float) -> float:
        """Seconds to keep between this read and the last."""
        leaders = self._leaders
        outranked = now + leaders.min_matchmaking_time - CLOCK_SKEW >= leaders.declared_expiration_time
        return LEADER_READS_QUIET if outranked else LEADER_READS_EVERY

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        pause = self._last_read + self.pause(now) - now
        if pause > 0:
            await asyncio.sleep(min(pause, max(0.0, self._leaders.search_end_time - now)))
        self._last_read = get_dht_time()
        found = await self._key_manager.get_averagers(*args, **kwargs)
        if any(peer != self._leaders.peer_id for peer, _ in found):
            self._leaders.swarm_others_at = get_dht_time()  # item 30
        return found


def _targets() -> list[tuple[Any, str, Any]]:
    from hivemind.averaging import matchmaking
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.utils import get_dht_time

    leaders = matchmaking.PotentialLeaders
    original, begin, pop = leaders._update_queue_periodically, leaders.begin_search, leaders.pop_next_leader

    async def _update_queue_at_most_every(self: Any, key_manager: Any) -> None:
        """hivemind's ``PotentialLeaders._update_queue_periodically`` itself, on paced reads (item 20). Runs
        in the averager process."""
        await original(self, PacedReads(key_manager, self))

    @contextlib.asynccontextmanager
    async def begin_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind's search, noting when it began and that nobody else was read yet (item 30)."""
        self.swarm_began, self.swarm_others_at = get_dht_time(), -float("inf")
        async with begin(self, *args, **kwargs) as found:
            yield found

    async def pop_next_leader(self: Any) -> Any:
        """hivemind's ``pop_next_leader``; at a declared expiration with nobody else read and no follower for
        the grace of :func:`give_up_alone`, the step fails (item 30): set as the search's result, the error
        ends ``look_for_group`` (matchmaking.py:126-136), which cancels this search; set on the step first,
        it ends the step's retries too (averaging/averager.py:470-478)."""
        try:
            return await pop(self)
        except TimeoutError:
            alone = getattr(self, "swarm_alone", None)
            if alone is None:
                raise
            grace, matchmaking = alone
            # since the search began or since the last read that found another averager declared (the one
            # a groupmate made just before it left is read for up to its matchmaking time)
            since = max(getattr(self, "swarm_began", float("inf")), getattr(self, "swarm_others_at", 0.0))
            waited = get_dht_time() - since
            step = matchmaking.step_control
            if matchmaking.current_followers or waited < grace or step is None:
                raise
            error = NobodyElseLooking(
                f"no other peer looked for a group for {waited:.1f} s: the peers counted in this round have "
                "left, or are far behind"
            )
            if not step.done():
                step.set_exception(error)
            if not matchmaking.assembled_group.done():
                matchmaking.assembled_group.set_exception(error)
            await asyncio.Event().wait()  # look_for_group, which now raises the error, cancels the search

    return [
        (DecentralizedAverager, _CONTROL, _set_target_group_size_here),
        (DecentralizedAverager, _ALONE, _give_up_alone_here),
        (leaders, "_update_queue_periodically", _update_queue_at_most_every),
        (leaders, "begin_search", begin_search),
        (leaders, "pop_next_leader", pop_next_leader),
    ]


PATCH = Patch("matchmaking", _targets)
