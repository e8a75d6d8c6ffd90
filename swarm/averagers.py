"""What this swarm changes in hivemind 1.1.12's averagers, in one place.

1. **A group closes as soon as every live peer is in it.** hivemind's matchmaking leader waits until its
   declared expiration (``matchmaking_time`` after it started looking) unless the group reaches
   ``target_group_size`` (hivemind/averaging/matchmaking.py, ``rpc_join_group``), and that size is fixed when
   the averager process starts. :func:`set_target_group_size` changes it in the running averager process,
   so the strategy can keep it equal to the number of peers the progress tracker sees: on loopback a round
   then starts within milliseconds instead of after ``matchmaking_time``. A peer that is counted but does not
   come (it died, or is still downloading the state) costs what it cost before: the leader waits until its
   expiration and averages with those who came (``min_group_size`` 2).
2. **A failed round never steps on zeros.** ``GradientAverager.step(reset_accumulators=True)`` zeroes the
   accumulators before the all-reduce; when the round then fails, hivemind.Optimizer "proceeds with local
   gradients" by loading those zeroed accumulators (optimizer.py ``_load_local_gradients_into_optimizer``),
   so the update is weight decay and momentum only and the round's samples are lost. :func:`round_averager`
   builds a gradient averager that keeps this peer's own mean gradient of the round and loads it instead,
   and counts how often that happened (``local_fallbacks``).
3. **One all-reduce part per buffer, not per tensor.** hivemind splits every tensor into its own parts
   (hivemind/averaging/partition.py), and each part costs a compression call in a thread, a message and a
   reply: the demo's 50 small tensors took 0.45 s to average on loopback, one tensor of the same 474 k
   numbers 0.18 s. The averagers built here (the state averager through :func:`install`) copy their tensors
   into one buffer per dtype and role, average the buffers, and copy the result back once the round has
   finished (a failed round leaves the tensors as they were). Not with size-dependent compression
   (``int8`` would then quantize small tensors with large ones), and not for PowerSGD, which averages
   matrices on its own.
4. **A newcomer never downloads a torn state.** hivemind's state averager hands its live tensors to the
   averager process, which serializes them after the lock is released, and hivemind.Optimizer runs the
   local update without that lock (``reuse_tensors=False``), so a download could catch a donor's update
   half-applied. :func:`install` makes the state averager copy its state under the lock, and
   :func:`lock_updates` holds the lock while the optimizer updates. Nor a state between two epochs:
   hivemind numbers the new epoch before the update and the state round that make it (state_averager.py,
   ``step`` then ``_do``), so a download in between got the new number with the old parameters, or this
   peer's own update before the group's average (in a test, a newcomer's parameters matched no peer's at
   any epoch). The state averager serves its state only once the epoch's step has ended, and copies it
   again when the next step began while it copied (that step's new number would go with the old tensors).
   It waits for that up to half of ``next_chunk_timeout`` (within which the downloader expects a first
   part) and then sends nothing, which hivemind's downloader takes as "ask the next peer".
5. **A pre-scheduled round is never cancelled.** hivemind.Optimizer pre-schedules the gradient round when
   the epoch is near, even with no other peer, and cancels it at the epoch's end when its tracker counts no
   other peer (optimizer.py, ``_begin_averaging_gradients``). A cancel that lands during matchmaking can
   leave the averager's matchmaking wedged: in one demo run, from a peer's first round on, every one of its
   rounds failed after ``averaging_timeout`` ("could not find a group") while the two other peers averaged
   every 4 s without it. :func:`never_cancel_rounds` schedules rounds only when the tracker sees other peers,
   and runs (instead of cancelling) a round that was scheduled when it did.
6. **Progress is reported a few times a second, not on every step.** hivemind's progress tracker stores a
   signed record in the DHT after every local step (progress_tracker.py, ``report_local_progress`` sets
   ``should_report_progress``, and ``_progress_reporter`` stores on each set), while other peers fetch
   progress at most every ``min_refresh_period`` (0.5 s). With the demo model a peer takes 60 to 80 steps a
   second, and the stores kept each peer's DHT process at 26 % of a core and its p2p daemon at 11 % on a
   2-core machine, CPU taken from training. :func:`throttle_progress_reports` sends a new epoch at once,
   and its first samples, otherwise at most one record per ``interval``; the last count of a burst is
   sent when the interval ends.
7. **No averaged result is applied unchecked.** An all-reduce hands every peer the group's mean, which one
   peer's outsized numbers move as far as they like (an attacker, or a bug: gradients 10,000 times too
   large took a 2-peer demo swarm to loss 3e6). :func:`screen_rounds` has a :class:`swarm.screen.RoundScreen`
   judge the averaged gradient before hivemind.Optimizer copies it into the optimizer
   (``_load_averaged_gradients_into_optimizer_``) and the averaged state before the state averager copies
   it into the model (``_apply_averaging_results_``), and every state download (``load_state_from_peers``,
   which hivemind.Optimizer runs whenever this peer falls behind the newest epoch); a rejected gradient
   round is replaced by this peer's own gradient of the round (as in item 2), a rejected state round or
   download leaves this peer's state as it was.

8. **A groupmate that never joins costs a second, not the whole round.** hivemind's matchmaking can put a
   peer into a group that the peer itself never learns of: a follower whose process was starved for longer
   than ``request_timeout`` gives up on its leader, while the leader has already accepted it and begun the
   all-reduce (matchmaking.py, ``_request_join_group`` and ``rpc_join_group``; a demo showed it about once
   in 120 rounds on 2 cores). The others then send it their parts, and its ``rpc_aggregate_part`` waits for
   a group that never registers (averager.py, ``_pending_groups_registered``), until the caller's
   ``allreduce_timeout`` (15 s in the demo): "received 50.0% of input tensors" on one side, "could not find
   a group" on the other. :func:`install` makes an averager answer a part of a group it does not know with
   ``BAD_GROUP_ID`` after ``request_timeout``, and makes the all-reduce drop a groupmate whose reducer failed
   before it sent anything, so the round ends with those who came.

9. **Peers that average together share one epoch.** A newcomer, or a peer that spent a few rounds alone,
   can reach the next round one epoch behind its groupmates: the progress tracker, refreshed every
   ``min_refresh_period``, makes a peer one epoch behind ready at once (``ready_to_update_epoch``), it joins
   the others' round and still steps only ``local_epoch + 1`` (optimizer.py, ``_update_global_epoch``);
   hivemind's exact-epoch check runs only after a progress fetch within the epoch, so with epochs shorter
   than the refresh period the two stay one apart, averaging every round with identical parameters under
   different epoch numbers (and learning rates). In a test run, a newcomer and the first peer averaged
   parameters at every round while one epoch apart. The state averager therefore runs with hivemind's
   ``sync_epoch_when_averaging`` (optim/state_averager.py, ``_do``): after a state round every member takes
   the group's newest epoch. :func:`sane_epochs` keeps a groupmate from moving it by more than one.
10. **A round is never skipped because the last one was pre-scheduled.** ``_begin_averaging_gradients``
   (optimizer.py) finds the control of the previous round still in ``scheduled_grads`` when no round was
   pre-scheduled for this one, logs "Not using pre-scheduled group ... already used elsewhere", drops it,
   and then starts no round at all (the fresh round is in the ``elif`` branch it no longer reaches): the
   peer steps alone, and its groupmates, whose rounds were pre-scheduled, wait for it until
   ``averaging_timeout``. A round is pre-scheduled only when the tracker's estimate says the epoch ends within
   ``matchmaking_time``, so this happens whenever the swarm is ready sooner than estimated, and always when
   DiLoCo's outer step calls ``_update_global_epoch`` after a fetch that found the swarm ready. In a DiLoCo
   test with the demo's timeouts, 2 of 11 rounds took 15 s so (one peer "alone", the other "local").
   :func:`never_cancel_rounds` drops the used control before hivemind looks at it, so a fresh round starts.
11. **A groupmate that never learnt of the group is met in the next gradient round, not waited for.** After
   item 8 the peers that ran the round go on to their state round, while the groupmate that never learnt of
   it still looks for a gradient group: each waits for the other in a different averager until
   ``averaging_timeout`` (in a scaling benchmark run: 14.4 s in gradient matchmaking on one peer, 12.9 s in
   the state round on the other). The gradient averagers built here name such groupmates (they answered
   ``BAD_GROUP_ID``) in the round's result, a :class:`Gathered` without them, and
   :func:`meet_strangers_next_round` makes the peer skip that epoch's state round: it computes the next
   epoch's samples and joins the gradient group in which the stranger still waits, whose state round then
   brings both to one epoch and the same parameters (item 9).
12. **A state round looks for its group for at most ``find_group_within`` seconds.** The same stranger can
   arise in a state round: its leader drops it (item 8) and goes on to the next epoch's gradient round, while
   the stranger looks for a state group until its step's deadline, and the leader then waits for it in
   gradient matchmaking (in a DiLoCo scaling run: 15.0 s in the state round on one peer, 11.6 s in gradient
   matchmaking on the other). hivemind uses one ``timeout`` for both the matchmaking deadline and the wait for
   the round's result (optim/state_averager.py ``_do``), so a shorter ``averaging_timeout`` would also cut
   off a long state all-reduce (ViT-B/32's gigabyte over the internet). The state averager built here
   shortens only the deadline of its own copy of the step in the averager process, where matchmaking and
   retries read it (averager.py ``_step``); the all-reduce keeps ``allreduce_timeout``. The strategy passes
   twice ``matchmaking_time``: a peer that arrives that late misses one state round, which costs nothing
   but the drift until the next.
13. **A download is numbered with the epoch it holds.** When the state a peer downloads is one epoch older
   than the swarm's newest (a donor that had not yet stepped served it, while another already had),
   hivemind.Optimizer moves the peer's epoch number on to the swarm's anyway ("Catching up with
   collaboration step", optim/optimizer.py:705-707), so the peer holds epoch N's parameters under N+1's
   number and applies N+1's average to them. With DiLoCo the anchors then differ from every other peer's for
   good (in a test, a newcomer announced epoch 46 and held both donors' anchor of epoch 45).
   :func:`download_the_epoch_it_names` downloads again (the donor that had not yet stepped has by then) and,
   if the state is still older, keeps the epoch number of the state it holds: hivemind's exact-epoch check
   then has it download at its next step (optimizer.py, ``_should_load_state_from_peers``).
14. **A peer reads the swarm's progress again soon when nobody's speed is known yet.** hivemind plans its
   next read of the swarm's progress from the estimated time to the target, made from the speeds in the
   peers' records, its own record included but not its live speed (progress_tracker.py
   ``_parse_swarm_progress_data``); in between only its own samples count. Records stored before a peer's
   first samples (``meet_peers`` stores them, so that peers started together count each other) carry no
   speed, the estimate is "never", and the next read is ``max_refresh_period`` (10 s) away: each peer then
   computed the whole target batch alone in every global epoch of its first 10 s, twice the target with 2
   peers (64 of 64 steps per peer and epoch in every scaling run of 2026-11-24 evening, all of whose 10
   epochs fit in those 10 s). :func:`read_soon_while_speeds_unknown` plans such a read
   ``min_refresh_period`` ahead instead; :func:`read_within` does it for a peer that waits with nothing to
   compute (DiLoCo after its H local steps).
15. **A new epoch expects the swarm at the speed the last read found.** At a new epoch hivemind sets the
   estimate to "never" (progress_tracker.py ``update_epoch``: ``eta_next_epoch = inf``), so until its next
   read of the swarm's progress a peer counts only its own samples and steps when they alone reach the
   target. Reads come at most every ``min_refresh_period`` (0.5 s); when the swarm fills the target batch
   sooner, every peer computed most of the target alone in every epoch (2026-11-24: 2.8x the target per
   epoch in the demo, 1.9x in the parity bench, whose swarm then trained on twice the global batch of the
   one process it is compared with). :func:`expect_the_swarm` keeps the summed speed of the last read's
   records and, at a new epoch, sets the estimate to the time the swarm needs for the target at that speed:
   the peer steps when the swarm should have the target between them, as it does after a read. The next
   read replaces the estimate as before. Not with DiLoCo, whose peers each take their H local steps.
16. **A state round whose group already holds one state is skipped.** After a gradient round in which the
   whole swarm took part, every peer applies the group's averaged gradient to its state, so peers that were
   equal stay equal, and averaging their parameters and AdamW moments changes nothing: yet with
   ``average_state_every`` 1 that round took 0.08 of the 0.13 s that ended each round of the scaling
   benchmark (2026-11-25, run 14). :func:`skip_state_rounds_in_agreement` has each peer send, with its
   gradient round's all-gather (hivemind's ``gather``), a summary of what its state round would average
   (each tensor's L1 and L2 norm), a digest of everything else its update depends on (the optimizer's step
   counters, learning rates, the epoch: :func:`state_summary`), and the number of training peers its
   tracker counts. The peers' results are equal only to rounding: each adds the delta (average - its own
   part) that the all-reduce returns to its own part (hivemind/averaging/allreduce.py:210), so norms count
   as equal within ``AGREEMENT_RTOL`` (1e-6; one AdamW step of the demo model moved its most-moved
   tensor's norm by 1.7e-2 to 0.67 of it in its first 30 steps). When every groupmate sent the same digest
   and norms, the group holds at least as many peers as any of them counts, no groupmate was a stranger
   (item 11) and this peer applied the group's average (not its own gradient after a rejected or failed
   round), the epoch's state round is skipped. Every member decides from the same gathered data, so the
   group skips together. Peers that differ (a partial round, a rejected result, a newcomer's first epochs)
   send different summaries and average their state as before. The summary is taken when the round is
   scheduled, after the previous epoch's update. With DiLoCo the extra tensors (each peer's inner AdamW
   state, which in the paper is never averaged and always differs between peers) are left out of the
   summary: a group that holds one anchor skips the round and each peer keeps its own inner moments. The
   outer momentum, which the state round does not average, is in the summary: peers whose momenta differ
   would part at the next outer step (seen in a fresh-clone test: anchors equal after every held round and
   1e-4 apart after every skipped one).
17. **AdamW's step counters follow the global epoch.** hivemind shares AdamW's step counters with a
   newcomer but never averages them, and a peer's counter grows only with the updates it ran: one that
   caught up or took a groupmate's newer epoch (item 9) skipped updates the others ran. At global epoch 60
   of a demo run the three peers' counters were 58, 60 and 61, so the bias corrections
   (1 - 0.999^t: 0.0563 against 0.0592) scaled their updates differently by about 2.5 %, although they
   applied the same averaged gradient to the same state; the state round of every epoch then averaged the
   difference away (and item 16 never found the group in agreement). :func:`number_steps_by_epoch` sets
   every counter to the epoch the update comes from just before the update, so that after the step
   to epoch E every peer's counter is E. Gradient averaging only (DiLoCo's inner counters are each peer's
   own local steps).

18. **A donor declares its new epoch at most every ``DECLARE_EVERY`` seconds.** hivemind's optimizer sets
   the state averager's ``state_sharing_priority`` to the new epoch at every global epoch
   (optimizer.py:502), and every change makes the averager store its donor record in the DHT at once
   (averager.py:243-249 and 600-625): one store per peer and round, 1 of the 7 that a scaling-bench peer
   made per round (2026-11-25, every ``DHT.store`` counted by key), each of which every node of a small
   swarm processes. The priority only orders the donors that a newcomer tries (averager.py
   ``load_state_from_peers``), and the state sent is whatever the donor holds when asked, numbered with its
   epoch (item 13). The state averager built here stores a changed priority at most every
   ``DECLARE_EVERY`` seconds, and reads it when it stores, so a record is never more than that behind.
   Switching sharing on or off is stored at once when it comes while the loop waits for a change, and at the
   end of the interval when it comes within ``DECLARE_EVERY`` of the last store (nothing in the swarm switches
   it while training). ``declare_state_period`` (hivemind's 30 s) must stay above ``DECLARE_EVERY``.

19. **A peer that finds nobody's progress reads again soon.** A read of the swarm's progress that finds no
   record at all, not even this peer's own (stored only once it has samples), plans the next read
   ``default_refresh_period`` (3 s) ahead (progress_tracker.py:280-292). Every tracker's first read, at its
   creation, is such a read when its peers start at the same moment, so peers started together without
   ``--min-peers`` each trained alone for the first 3 s: in a fresh-clone run of the 4-peer localhost test
   (2026-11-25), peer1 and peer2, started 20 ms apart, each took their first 14 and 15 global epochs alone,
   and held different parameters at 16 of the 148 epochs they shared (0.89, below the test's 0.9). Item 14's
   wrapper plans such a read ``min_refresh_period`` ahead too, and brings forward a read that was planned
   before it was installed. A peer that trains alone stores its own record at its first step, so only
   reads before that are affected.

20. **Matchmaking reads the DHT at most every ``LEADER_READS_EVERY`` seconds.** While a peer looks for a
   group, hivemind's ``PotentialLeaders.pop_next_leader`` asks for a new read of the declared averagers
   whenever the queue holds no leader to try, and ``_update_queue_periodically`` reads again as soon as it
   is asked (matchmaking.py:469-522): back to back for as long as the peer waits for a groupmate, each read a
   request through the DHT process and the p2p daemon to every node. In a 2-peer DiLoCo run on 2 cores
   (2026-11-25, 30 outer rounds) the gradient averagers made 956 and 551 such reads, 18 to 32 per round,
   with CPU taken from the groupmate that was still computing, the one being waited for. :func:`install`
   runs hivemind's loop on a key manager whose reads come at least ``LEADER_READS_EVERY`` apart (34 reads
   per peer in the same run). The waiting peer is not always the leader: a round pre-scheduled at the
   tracker's estimate of the epoch's end declares that time (matchmaking.py
   ``_declare_averager_periodically``), which can lie after a later peer's, and then the waiting peer finds
   its leader only by reading. So the pause is short: with 0.1 s, DiLoCo's outer rounds ended about 50 ms
   later (median 83-174 ms against 76-124 ms without the pause, over 5 A/B pairs). With 0.025 s
   (2026-11-25 19:20, 3 alternating pairs each, 2 peers, batch 32): gradient averaging at target 2048, 40
   epochs, 6262 / 6340 / 6545 samples/s against 5473 / 5865 / 6313 without the pause (+8.5 % on average,
   faster in every pair; 25.2 against 26.5 CPU seconds per peer); DiLoCo H=50, 25 outer rounds, 6412 /
   6332 / 6345 against 6407 / 6315 / 5787, median round end 0.10-0.14 s against 0.12-0.17 s.

The subclasses keep hivemind's class names: the p2p handlers' names are built from the class name, and must
match those of other peers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from functools import cache
from typing import Any, get_type_hints

import torch

log = logging.getLogger(__name__)


async def _set_target_group_size_here(self: Any, size: int | None) -> None:
    """Runs inside the averager process (sent over hivemind's control pipe)."""
    matchmaking = getattr(self, "_matchmaking", None)
    if matchmaking is not None:
        # the key manager keeps its own copy, used to pick group bits; left alone, since a follower of a
        # larger group than its own target would fail there (and the swarm uses no group bits)
        matchmaking.target_group_size = size


async def _rpc_aggregate_part(self: Any, stream: Any, context: Any) -> Any:
    """hivemind's ``DecentralizedAverager.rpc_aggregate_part``, with a bounded wait for an unknown group
    (item 8). Runs in the averager process."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import achain, anext, as_aiter

    request = await anext(stream)
    if request.group_id not in self._running_groups:
        # hivemind waits here without a limit, for a leader's answer that is still on its way
        try:
            await asyncio.wait_for(self._pending_groups_registered.wait(), self._matchmaking.request_timeout)
        except TimeoutError:
            pass
    future = self._running_groups.get(request.group_id)
    if future is None:
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        return
    group = await future
    async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
        yield message


async def _communicate_with_peer(self: Any, peer_id: Any) -> None:
    """hivemind's ``AllReduceRunner._communicate_with_peer``; a groupmate whose reducer failed before it sent
    a single part is dropped as a sender too (item 8), instead of being awaited for ``sender_timeout``. One
    that answered ``BAD_GROUP_ID`` (hivemind's allreduce.py raises "<peer> sent BAD_GROUP_ID") never learnt
    of the group: it is named a stranger (item 11)."""
    try:
        await _HIVEMIND["communicate_with_peer"](self, peer_id)
    except Exception as exc:
        if peer_id in self.sender_peer_ids and peer_id not in self.active_senders:
            if str(exc).endswith("sent BAD_GROUP_ID"):
                self.__dict__.setdefault("_swarm_strangers", set()).add(peer_id)
            await self._ban_sender(peer_id)
        raise


class Gathered(dict):
    """What an averaging round gathered, by peer, without the groupmates that never learnt of the group;
    ``strangers`` names those (item 11). Travels from the averager process to the peer's (pickled)."""

    strangers: frozenset = frozenset()

    @classmethod
    def without(cls, gathered: dict, strangers: Any) -> Gathered:
        out = cls((peer, data) for peer, data in gathered.items() if peer not in strangers)
        out.strangers = frozenset(strangers)
        return out


class _NamesStrangers:
    """Mixin for hivemind's gradient averagers: item 11 of the module docstring. Runs in the averager
    process."""

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        # the round's runner stays registered until this returns (averager.py, _register_allreduce_group)
        future = self._running_groups.get(group_info.group_id)
        runner = future.result() if future is not None and future.done() else None
        strangers = getattr(runner, "_swarm_strangers", ())
        return Gathered.without(gathered, strangers) if strangers else gathered


_HIVEMIND: dict[str, Any] = {}


def install() -> None:
    """Teach hivemind's averager processes to take a new target group size, and not to wait for groupmates
    that never come (item 8). Idempotent; call before the averagers start (their processes are forked with
    the class as it is then)."""
    from hivemind.averaging import matchmaking
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.optim import optimizer, state_averager

    if not hasattr(DecentralizedAverager, "_swarm_set_target_group_size"):
        DecentralizedAverager._swarm_set_target_group_size = _set_target_group_size_here
    if "communicate_with_peer" not in _HIVEMIND:
        _HIVEMIND["communicate_with_peer"] = AllReduceRunner._communicate_with_peer
        AllReduceRunner._communicate_with_peer = _communicate_with_peer
        # the p2p handler's request type is read from the annotations (hivemind/p2p/servicer.py)
        _rpc_aggregate_part.__annotations__ = get_type_hints(DecentralizedAverager.rpc_aggregate_part)
        DecentralizedAverager.rpc_aggregate_part = _rpc_aggregate_part
    # hivemind.Optimizer builds its state averager from this module-level name
    optimizer.TrainingStateAverager = _state_averager_class(state_averager.TrainingStateAverager)
    if "update_queue_periodically" not in _HIVEMIND:  # item 20
        _HIVEMIND["update_queue_periodically"] = matchmaking.PotentialLeaders._update_queue_periodically
        matchmaking.PotentialLeaders._update_queue_periodically = _update_queue_at_most_every


LEADER_READS_EVERY = 0.025  # item 20: seconds between two reads of the declared averagers, at least


async def _update_queue_at_most_every(self: Any, key_manager: Any) -> None:
    """hivemind's ``PotentialLeaders._update_queue_periodically`` (matchmaking.py:500-522) itself, on a key
    manager whose reads of the declared averagers come at least ``LEADER_READS_EVERY`` apart (item 20). Runs
    in the averager process."""
    await _HIVEMIND["update_queue_periodically"](self, _PacedReads(key_manager, self))


class _PacedReads:
    """A ``GroupKeyManager`` whose ``get_averagers`` waits until ``LEADER_READS_EVERY`` after its last read,
    though never past the search's end (``leaders.search_end_time``); everything else is the key manager's."""

    def __init__(self, key_manager: Any, leaders: Any) -> None:
        self._key_manager, self._leaders = key_manager, leaders
        self._last_read = -float("inf")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key_manager, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        from hivemind.utils import get_dht_time

        pause = self._last_read + LEADER_READS_EVERY - get_dht_time()
        if pause > 0:
            await asyncio.sleep(min(pause, max(0.0, self._leaders.search_end_time - get_dht_time())))
        self._last_read = get_dht_time()
        return await self._key_manager.get_averagers(*args, **kwargs)


def set_target_group_size(averager: Any, size: int | None) -> None:
    """Make ``averager``'s matchmaking close a group once it has ``size`` peers (None: wait the whole
    matchmaking time). Cheap when the size did not change; a no-op once the averager process is gone."""
    if getattr(averager, "_swarm_target_group_size", "unset") == size or not averager.is_alive():
        return
    averager._swarm_target_group_size = size
    averager._outer_pipe.send(("_swarm_set_target_group_size", [size], {}))


def _packable(averager: Any) -> bool:
    from hivemind.compression import SizeAdaptiveCompression
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

    return not isinstance(averager, PowerSGDGradientAverager) and not isinstance(
        averager.allreduce_kwargs.get("compression"), SizeAdaptiveCompression
    )


class _PacksParts:
    """Mixin for hivemind's averagers: item 3 of the module docstring. Runs in the averager process."""

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        if not _packable(self) or len(tensors) < 2:
            return await super()._run_allreduce_inplace_(tensors, group_info, *args, **kwargs)
        from hivemind.compression import CompressionInfo

        infos = kwargs.get("tensor_infos") or [
            CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)
        ]
        groups: dict[tuple, list[int]] = {}  # one buffer per dtype and role (roles choose the compression)
        for i, (t, info) in enumerate(zip(tensors, infos, strict=True)):
            groups.setdefault((t.dtype, info.role), []).append(i)
        with torch.no_grad():
            buffers = [torch.cat([tensors[i].detach().reshape(-1) for i in idx]) for idx in groups.values()]
        kwargs["tensor_infos"] = [
            CompressionInfo.from_tensor(buf, key=n, role=role)
            for n, (buf, (_, role)) in enumerate(zip(buffers, groups, strict=True))
        ]
        result = await super()._run_allreduce_inplace_(buffers, group_info, *args, **kwargs)
        with torch.no_grad():  # only a finished round changes the tensors
            for buf, idx in zip(buffers, groups.values(), strict=True):
                for i, part in zip(idx, buf.split([tensors[i].numel() for i in idx]), strict=True):
                    tensors[i].copy_(part.view_as(tensors[i]))
        return result


_ROLE_NAMES = {"PARAMETER": "parameters", "OPTIMIZER": "optimizer statistics"}


def _roles(averager: Any) -> list[str]:
    """What each of a state averager's tensors is, as the screen names it (item 7)."""
    return [_ROLE_NAMES.get(info.role.name, "extra tensors") for info in averager.tensor_infos]


def sane_epochs(gathered: dict, own_id: Any) -> dict:
    """The epochs that a state averaging round gathered (item 9), each one an int from this peer's own epoch
    up to one more: a groupmate's malformed or far-ahead epoch must not move this peer (one that is further
    ahead hands its state over through hivemind's catch-up download instead)."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    own = gathered.get(own_id)
    if not is_int(own):
        return {}
    return {peer: min(e, own + 1) if is_int(e) and e > own else own for peer, e in gathered.items()}


@cache
def _state_averager_class(base: type) -> type:
    def __init__(self: Any, *args: Any, find_group_within: float | None = None, **kwargs: Any) -> None:
        self._swarm_settled = threading.Event()  # clear while an epoch's step runs (item 4)
        self._swarm_settled.set()
        self._swarm_steps = 0  # epoch steps begun (item 4)
        self._swarm_find_group_within = find_group_within  # item 12; set before the averager process forks
        base.__init__(self, *args, **kwargs)  # starts the thread that serves the state

    async def _step(self: Any, *, step: Any, **kwargs: Any) -> Any:
        """hivemind's averaging step, in the averager process, with its matchmaking deadline shortened to
        ``find_group_within`` seconds from now (item 12): this process's copy of the step control is the one
        that matchmaking and the retry loop read; the caller's wait for the result is left as it was."""
        from hivemind.utils import get_dht_time

        within = self._swarm_find_group_within
        if within is not None:
            step._deadline = min(step.deadline, get_dht_time() + within)
        return await base._step(self, step=step, **kwargs)

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind's step; an epoch's step (increment_epoch) is unsettled until it returns. The swarm runs
        it synchronously (no delayed updates or averaging): the update and the state round are done then."""
        if not kwargs.get("increment_epoch"):
            return base.step(self, *args, **kwargs)
        self._swarm_steps += 1
        self._swarm_settled.clear()
        try:
            return base.step(self, *args, **kwargs)
        finally:
            self._swarm_settled.set()

    def get_current_state(self: Any) -> tuple[Any, list[torch.Tensor], list[Any]]:
        """hivemind's get_current_state (optim/state_averager.py), once the epoch's step has ended, with
        copies taken under the lock (item 4)."""
        from itertools import chain

        from hivemind.compression import CompressionInfo, TensorRole
        from hivemind.optim.state_averager import dump_optimizer_state

        wait = 0.5 * (self.next_chunk_timeout or 10.0)  # hivemind's downloader waits that long for a part
        deadline = time.monotonic() + wait
        while True:
            if not self._swarm_settled.wait(max(0.0, deadline - time.monotonic())):
                log.info("Sent no state to a peer: this one was in an epoch's step for %.1f s", wait)
                return None, [], []  # no part: the downloader asks the next peer (averager.py)
            begun = self._swarm_steps
            with torch.no_grad(), self.lock_averaged_tensors:
                params = [
                    p.detach().to("cpu", copy=True) for g in self.optimizer.param_groups for p in g["params"]
                ]
                extra = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
                opt_metadata, opt_tensors = dump_optimizer_state(self.optimizer)
                opt_tensors = [t.clone() for t in opt_tensors]
                epoch = self.local_epoch
            # hivemind numbers the new epoch as the step begins, without the lock (state_averager.py, step):
            # a step that began while this copied can have given the old tensors the new number (in a test,
            # a newcomer announced epoch 37 and held both donors' anchor of 36); copied again once it ended
            if self._swarm_settled.is_set() and self._swarm_steps == begun:
                break
        infos = [
            CompressionInfo.from_tensor(p, key=k, role=TensorRole.PARAMETER)
            for p, k in zip(params, self.parameter_names, strict=True)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extra)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(opt_tensors)
        ]
        metadata = dict(epoch=epoch, group_bits=self.get_group_bits(), optimizer_metadata=opt_metadata)
        return metadata, list(chain(params, extra, opt_tensors)), infos

    def _apply_averaging_results_(self: Any) -> None:
        """hivemind's copy of the averaged state into the model, unless the screen rejects it (item 7)."""
        screen = getattr(self, "screen", None)
        if screen is not None:
            with torch.no_grad(), self.get_tensors() as averaged:
                reason = screen.judge_state(list(self._local_tensors()), averaged, _roles(self))
            if reason is not None:
                self.on_rejected("state", reason, 0)
                return
        base._apply_averaging_results_(self)

    def load_state_from_peers(self: Any, **kwargs: Any) -> Any:
        """hivemind's state download, judged (item 7); ``swarm_held_epoch`` then says which epoch the
        tensors are (item 13)."""
        try:
            return _load_screened(self, **kwargs)
        finally:
            self.swarm_held_epoch = self.local_epoch

    def _load_screened(self: Any, **kwargs: Any) -> Any:
        """hivemind's state download, judged like an averaging round (item 7): hivemind.Optimizer downloads
        from the peer with the newest epoch whenever this peer falls behind, and an attacker that runs ahead
        would otherwise hand its state over. A rejected download is undone; the peer keeps its own tensors
        and takes the newer epoch (so it does not download again at the next step)."""
        screen = getattr(self, "screen", None)
        if screen is None:
            return base.load_state_from_peers(self, **kwargs)
        with torch.no_grad(), self.lock_averaged_tensors:
            before = [t.detach().clone() for t in self._local_tensors()]
        epoch = self.local_epoch
        result = base.load_state_from_peers(self, **kwargs)
        if self.local_epoch == epoch:
            return result  # nothing was loaded
        with torch.no_grad(), self.lock_averaged_tensors:
            reason = screen.judge_state(before, list(self._local_tensors()), _roles(self), kind="download")
            if reason is not None:
                for mine, now in zip(before, self._local_tensors(), strict=True):
                    now.copy_(mine)
        if reason is not None:
            if not self.reuse_tensors:  # takes the (non-reentrant) tensor lock itself
                self._load_local_tensors_into_averager_()
            self.on_rejected("download", reason, 0)
        return result

    async def _aggregate_with_group(self: Any, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind's averaging round, with the groupmates' epochs made safe for ``sync_epoch_when_averaging``
        (item 9). Runs in the averager process."""
        gathered = await base._aggregate_with_group(self, group_info, *args, **kwargs)
        return sane_epochs(gathered, self.peer_id)

    async def _declare_for_download_periodically(self: Any) -> None:
        """hivemind's loop that declares this peer a donor of its state in the DHT (averager.py:600-625),
        storing a changed priority at most once per ``DECLARE_EVERY`` seconds (item 18). Runs in the
        averager process."""
        from hivemind.utils import get_dht_time

        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or sharing_was_allowed:
                # the priority (the epoch) is read now: a store that waited carries the newest one
                value = self.state_sharing_priority if self.allow_state_sharing else None
                store = self.dht.store(
                    download_key,
                    subkey=self.peer_id.to_bytes(),
                    value=value,
                    expiration_time=expiration_time,
                    return_future=True,
                )
                asyncio.create_task(asyncio.wait_for(store, timeout=expiration_time - get_dht_time()))
                sharing_was_allowed = self.allow_state_sharing
            stored = time.monotonic()
            self._state_updated.clear()
            try:
                left = max(0.0, expiration_time - get_dht_time())
                await asyncio.wait_for(self._state_updated.wait(), timeout=left)
            except TimeoutError:
                pass
            if self.allow_state_sharing == sharing_was_allowed:  # sharing switched on or off goes at once
                await asyncio.sleep(max(0.0, stored + DECLARE_EVERY - time.monotonic()))

    attrs = {
        "__module__": __name__,
        "__init__": __init__,
        "_declare_for_download_periodically": _declare_for_download_periodically,
        "_step": _step,
        "step": step,
        "_aggregate_with_group": _aggregate_with_group,
        "get_current_state": get_current_state,
        "_apply_averaging_results_": _apply_averaging_results_,
        "load_state_from_peers": load_state_from_peers,
    }
    return type(base.__name__, (_PacksParts, base), attrs)


def lock_updates(state_averager: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Hold ``state_averager``'s tensor lock while ``optimizer`` updates (item 4); returns the hooks."""
    lock = state_averager.lock_averaged_tensors

    def acquire(*args: Any) -> None:
        lock.acquire()

    def release(*args: Any) -> None:
        lock.release()

    return [optimizer.register_step_pre_hook(acquire), optimizer.register_step_post_hook(release)]


def number_steps_by_epoch(state_averager: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Item 17 of the module docstring: before each update, every ``step`` counter in ``optimizer``'s state
    is set to the global epoch the update comes from; returns the hook. Register it after
    :func:`lock_updates`' hooks, so that it runs under the tensor lock."""

    @torch.no_grad()
    def number(*args: Any) -> None:
        # hivemind numbers the new epoch before it runs the update (state_averager.py, step then _do)
        done = float(max(0, state_averager.local_epoch - 1))
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.fill_(done)
            elif isinstance(step, int | float):
                state["step"] = type(step)(done)

    return optimizer.register_step_pre_hook(number)


class _ThrottledReports(threading.Event):
    """The tracker's ``should_report_progress``: releases its reporter at once for a new epoch and for the
    epoch's first samples, otherwise at most once per ``interval`` seconds; a set that comes too early is
    released when the interval ends. The reporter thread itself waits out the interval, in :meth:`wait`
    (hivemind runs that wait in an executor thread, progress_tracker.py:204): earlier versions started a
    ``threading.Timer`` for it, a new thread per interval, started from the training step."""

    def __init__(self, tracker: Any, interval: float) -> None:
        super().__init__()
        self.tracker, self.interval = tracker, interval
        self.last, self.last_key = -float("inf"), None
        self.fired = 0  # records this peer let the tracker store
        self._pending = False
        self._wake = threading.Condition()

    def is_set(self) -> bool:
        return self._pending

    def set(self) -> None:
        with self._wake:
            self._pending = True
            self._wake.notify_all()

    def clear(self) -> None:
        with self._wake:
            self._pending = False

    def _key(self) -> tuple[int, bool]:
        # (epoch, has samples) new: at once. hivemind's reporter stops storing once no record of the last
        # two epochs carried samples (progress_tracker.py:213-216), and the epoch's first record (from
        # update_epoch) has none: with epochs shorter than the interval, holding back the first record with
        # samples made the peer vanish from the others' count, and both stepped alone
        progress = self.tracker.local_progress
        return progress.epoch, progress.samples_accumulated > 0

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while True:
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if not self._pending:
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(left)
                    continue
                hold = self.last + self.interval - now
                # a wait that times out during the hold releases too (hivemind stores on its timeout anyway),
                # and so does the tracker's shutdown (its reporter then ends)
                stopping = self.tracker.shutdown_triggered.is_set()
                if self._key() != self.last_key or hold <= 0 or (left is not None and left <= 0) or stopping:
                    self.last, self.last_key = now, self._key()
                    self.fired += 1
                    return True
                self._wake.wait(hold if left is None else min(hold, left))  # a new epoch's set() ends it


def throttle_progress_reports(tracker: Any, interval: float) -> None:
    """Item 6 of the module docstring, on one running ``ProgressTracker`` (``interval`` 0 leaves it be)."""
    if interval <= 0 or isinstance(tracker.should_report_progress, _ThrottledReports):
        return
    previous, throttled = tracker.should_report_progress, _ThrottledReports(tracker, interval)
    if previous.is_set():
        throttled.set()
    tracker.should_report_progress = throttled
    previous.set()  # wakes the reporter from its wait on the old event; from its next turn it waits on ours


def read_soon_while_speeds_unknown(tracker: Any, below: float = 1e-6) -> None:
    """Item 14 of the module docstring, on one running ``ProgressTracker``: a read of the swarm's progress
    whose records carry no speed above ``below`` samples/s in all plans the next read ``min_refresh_period``
    ahead, not ``max_refresh_period``. hivemind's speeds start at 1e-20 (utils/performance_ema.py). Only the
    records count, as in hivemind's estimate: a peer that has stepped but not yet stored a record with its
    speed still reads soon. A read that finds no record at all does the same (item 19), and a tracker whose
    reads so far found none reads again within ``min_refresh_period`` of this call."""
    parse = tracker._parse_swarm_progress_data
    if getattr(parse, "_swarm_reads_soon", False):
        return
    from hivemind.utils import get_dht_time

    def parsed(metadata: Any) -> Any:
        progress = parse(metadata)
        tracker._swarm_last_read = (0.0, 0)  # summed speed of the records, peers: kept for item 15
        try:
            entries = metadata.values() if isinstance(metadata, dict) else ()
            known = sum(_record_speed(e) for e in entries)
            tracker._swarm_last_read = (known, progress.num_peers)
            if known < below:  # no speed known, or no record at all (item 19)
                soon = get_dht_time() + tracker.min_refresh_period
                progress.next_fetch_time = min(progress.next_fetch_time, soon)
        except Exception:  # an unreadable record leaves hivemind's plan as it was; never stop the fetcher
            log.debug("Could not check the speeds in the swarm's progress records", exc_info=True)
        return progress

    parsed._swarm_reads_soon = True  # type: ignore[attr-defined]
    tracker._parse_swarm_progress_data = parsed
    if not tracker.global_progress.num_peers:  # its first read (at its creation) may have found nobody
        read_within(tracker, tracker.min_refresh_period)


def _record_speed(entry: Any) -> float:
    """The speed (samples/s) in one record of the swarm's progress as the DHT returns it; 0 if unreadable."""
    value = getattr(entry, "value", None)
    number = value.get("samples_per_second") if isinstance(value, dict) else None
    return float(number) if isinstance(number, int | float) else 0.0


def expect_the_swarm(tracker: Any) -> None:
    """Item 15 of the module docstring, on one running ``ProgressTracker``; the last read's summed speed is
    the one that item 14's wrapper (installed here if it is not yet) notes at each read."""
    read_soon_while_speeds_unknown(tracker)
    update = tracker.update_epoch
    if getattr(update, "_swarm_expects", False):
        return
    from hivemind.utils import get_dht_time

    def update_epoch(new_epoch: int | None = None) -> int:
        epoch = update(new_epoch)
        seen, (speed, peers) = tracker.global_progress, getattr(tracker, "_swarm_last_read", (0.0, 0))
        # only a fresh epoch, which hivemind left without an estimate, and only with other peers to count on
        if seen.epoch == epoch and seen.eta_next_epoch == float("inf") and peers > 1 and speed > 0:
            seen.eta_next_epoch = get_dht_time() + tracker.target_batch_size / speed
        return epoch

    update_epoch._swarm_expects = True  # type: ignore[attr-defined]
    tracker.update_epoch = update_epoch


def read_within(tracker: Any, seconds: float) -> None:
    """Have a running ``ProgressTracker`` read the swarm's progress within ``seconds`` (a no-op when its next
    read is due by then), for a peer that waits for the swarm with nothing left to compute: DiLoCo after its
    H local steps. Called on every turn of such a wait, it makes the tracker read every ``seconds``.

    hivemind plans the next read from its estimate of when the swarm reaches the target (item 14), and a
    waiting peer adds no samples of its own: with an estimate made from speedless records both DiLoCo peers
    of a scaling bench waited 9.2 s for the read at their first outer step, and DiLoCo fell from 0.55x to
    0.28x DDP (2026-11-24, run 9). Item 14 now avoids that estimate; this bounds the wait whatever the
    estimate was (a peer that slowed down or left). Waking the fetcher with ``global_state_updated`` makes
    it plan its wait again from the moved ``next_fetch_time`` (progress_tracker.py:256-263)."""
    from hivemind.utils import get_dht_time

    seen, due = tracker.global_progress, get_dht_time() + seconds
    if seen.next_fetch_time > due:
        seen.next_fetch_time = due
        tracker.global_state_updated.set()


def meet_peers(tracker: Any, count: int, stop: Any, within: float = 10.0, every: float = 0.25) -> int:
    """Before the first step of peers started together (``--min-peers``): store this peer's progress record
    now and have its running ``ProgressTracker`` read the swarm's progress every ``every`` seconds, until it
    sees ``count`` peers (this one included), ``stop`` (an Event) is set, or ``within`` seconds pass. Returns
    how many peers the tracker sees.

    A peer stores its first progress record only once it has samples (progress_tracker.py:213-216), and a
    tracker that found no peer reads again only after ``default_refresh_period``, 3 s
    (progress_tracker.py:291). So peers that ``--min-peers`` released together each saw the swarm empty and
    trained alone: 1 to 3 of 10 epochs in the scaling bench, and in a fresh-clone suite all 20 of the
    demo's 0.1 s epochs of both peers (2026-11-24). Reading more often was not enough: a peer that started
    its first step 0.5 s after the other found it 4 epochs ahead and only ever downloaded its state. The
    record stored here is the one the reporter would store (epoch, 0 samples, no speed yet), so the others
    count this peer from the start; moving ``next_fetch_time`` to now and waking the fetcher with
    ``global_state_updated`` makes it read at once (progress_tracker.py:256-263).
    """
    from hivemind.utils import get_dht_time

    progress = tracker.local_progress
    tracker.dht.store(
        key=tracker.training_progress_key,
        subkey=tracker._local_public_key,
        value=progress.dict(),
        expiration_time=get_dht_time() + tracker.metadata_expiration,
        return_future=True,
    )
    deadline = time.monotonic() + within
    while not stop.is_set() and time.monotonic() < deadline:
        seen = tracker.global_progress
        if seen.num_peers >= count:
            break
        read_within(tracker, 0.0)
        stop.wait(every)
    return tracker.global_progress.num_peers


def download_the_epoch_it_names(opt: Any, attempts: int = 3, pause: float = 0.5) -> None:
    """Make ``opt.load_state_from_peers`` (hivemind.Optimizer's, which its ``step`` also calls) leave the peer
    with the epoch number of the state it downloaded (item 13): up to ``attempts`` downloads, ``pause``
    seconds apart, while the one downloaded is older than the epoch hivemind then moved on to."""
    load = opt.load_state_from_peers
    averager = opt.state_averager

    def load_state_from_peers(**kwargs: Any) -> Any:
        for attempt in range(1, attempts + 1):
            averager.swarm_held_epoch = None
            result = load(**kwargs)
            held = averager.swarm_held_epoch
            if held is None or opt.local_epoch <= held:
                return result
            named = opt.local_epoch
            averager.local_epoch = held  # undo hivemind's catch-up: these tensors are epoch `held`
            with opt.tracker.pause_updates():
                opt.tracker.report_local_progress(held, samples_accumulated=0)
            if not opt.client_mode:
                averager.state_sharing_priority = held
                if opt.grad_averager is not None:
                    opt.grad_averager.state_sharing_priority = held
            if attempt < attempts:
                log.info(
                    "Downloaded the state of global epoch %d while the swarm is at %d; downloading again",
                    held,
                    named,
                )
                time.sleep(pause)
        log.info(
            "Kept global epoch %d, the epoch of the state downloaded (the swarm is at %d); "
            "the next step downloads again",
            held,
            named,
        )
        return result

    opt.load_state_from_peers = load_state_from_peers


def never_cancel_rounds(opt: Any) -> None:
    """Item 5 of the module docstring, on one ``hivemind.Optimizer`` instance (wraps two of its methods)."""
    schedule, begin = opt._maybe_schedule_gradient_averaging, opt._begin_averaging_gradients

    def schedule_with_peers() -> None:
        if opt.tracker.global_progress.num_peers > 1:
            schedule()

    def begin_without_cancelling(grad_scaler: Any) -> bool:
        control = opt.scheduled_grads
        if control is not None and (control.triggered or control.done()):
            # the previous round's control, never scheduled anew (item 10): hivemind would drop it and then
            # skip this round altogether; dropped here, hivemind starts a round of its own below
            opt.scheduled_grads = control = None
        if control is not None and opt.tracker.global_progress.num_peers <= 1:
            # the round was scheduled while other peers were seen: run it (if they are gone, it fails at its
            # deadline and this peer steps on its own gradient) rather than cancel it
            opt.scheduled_grads = opt.grad_averager.step(control=control, reset_accumulators=True, wait=False)
            return True
        return begin(grad_scaler)

    opt._maybe_schedule_gradient_averaging = schedule_with_peers
    opt._begin_averaging_gradients = begin_without_cancelling


def _skip_state_rounds_after(opt: Any, note: Any, on_skip: Any, before: Any = lambda: None) -> None:
    """Items 11 and 16: after each finished gradient round, ``note(gathered, before())`` (``before`` called as
    the round began) says why the epoch's state round is to be skipped, or None; the state round (one not
    pre-scheduled) is then skipped and ``on_skip(epoch, why)`` told."""
    average, state_step = opt._average_gradients_and_load_into_optimizer, opt.state_averager.step
    pending: list[Any] = []

    def average_noting(control: Any) -> Any:
        pending.clear()
        then = before()
        try:
            return average(control)
        finally:
            if control is not None and control.done() and not control.cancelled() and not control.exception():
                why = note(control.result(), then)
                if why is not None:
                    pending.append(why)

    def step(*args: Any, **kwargs: Any) -> Any:
        if pending and kwargs.get("increment_epoch"):
            why = pending.pop()
            if kwargs.get("averaging_round") and kwargs.get("averaging_control") is None:
                kwargs.update(averaging_round=False, averaging_opts=None)
                if on_skip is not None:
                    on_skip(opt.local_epoch + 1, why)
        return state_step(*args, **kwargs)

    opt._average_gradients_and_load_into_optimizer = average_noting
    opt.state_averager.step = step


def meet_strangers_next_round(opt: Any, on_skip: Any = None) -> None:
    """Item 11 of the module docstring, on one ``hivemind.Optimizer`` instance: after a gradient round whose
    result names strangers, that epoch's state round is skipped. ``on_skip(epoch, strangers)`` is told."""
    _skip_state_rounds_after(opt, lambda gathered, _: getattr(gathered, "strangers", None) or None, on_skip)


DECLARE_EVERY = 5.0  # item 18: seconds between two of a donor's declarations that only change its epoch
AGREEMENT_RTOL = 1e-6  # item 16: figures this close count as one state (all-reduce rounding is ~1e-7)


def state_summary(opt: Any, local_extras: bool = False) -> dict[str, Any]:
    """Item 16: what ``opt``'s state round would average, summarised: ``norms``, each tensor's L1 and L2 norm
    (parameters, averaged optimizer statistics, extra tensors unless ``local_extras``, and the optimizer's
    other state tensors, such as SGD's momentum; float64, one fused call each), and ``exact``, a digest of
    what else the next update depends on and must match exactly (every one-number tensor of the optimizer's
    state, such as AdamW's step counters; each group's learning rate and weight decay; the epoch)."""
    averager = opt.state_averager
    with torch.no_grad():
        shared = list(averager._local_tensors())  # parameters, statistics, then the extra tensors (last)
        if local_extras:
            shared = shared[: len(shared) - len(averager.extra_tensors)]
        # and the optimizer's state that the round does not average but the next update reads: DiLoCo's outer
        # momentum (average_opt_statistics is empty there). Left out, peers that agreed on the anchors took
        # outer steps with different momenta and parted right after every skipped round
        known = {id(t) for t in shared}
        shared += [
            v
            for state in averager.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1 and id(v) not in known
        ]
        tensors = [t.detach() for t in shared if t.is_floating_point() and t.numel()]
        norms: list[float] = []
        for order in (1, 2) if tensors else ():
            norms += torch.stack(torch._foreach_norm(tensors, order, dtype=torch.float64)).cpu().tolist()
        counters = [
            float(v)
            for state in averager.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel() == 1
        ]
    hyper = [float(g.get(k, 0.0)) for g in averager.optimizer.param_groups for k in ("lr", "weight_decay")]
    exact = hashlib.blake2b(digest_size=16)
    exact.update(torch.tensor(counters + hyper, dtype=torch.float64).numpy().tobytes())
    exact.update(str(opt.local_epoch).encode())
    return {"norms": norms, "exact": exact.digest()}


def in_agreement(gathered: Any, rtol: float = AGREEMENT_RTOL) -> bool:
    """Item 16: whether a gradient round's all-gather shows one state across a group of the whole swarm:
    the same ``exact`` digest, every norm within ``rtol`` of the first groupmate's, and a group at least as
    large as any member's count of training peers. ``gathered`` maps each groupmate to what it sent
    (``{"state": state_summary or None, "peers": int}``); anything malformed counts as disagreement."""
    if not isinstance(gathered, dict) or len(gathered) < 2 or getattr(gathered, "strangers", None):
        return False
    sent = list(gathered.values())
    states = []
    for data in sent:
        if not isinstance(data, dict) or type(data.get("peers")) is not int:
            return False
        state = data.get("state")
        if not (
            isinstance(state, dict)
            and isinstance(state.get("exact"), bytes)
            and isinstance(state.get("norms"), list | tuple)
            and all(type(x) is float and math.isfinite(x) for x in state["norms"])
        ):
            return False
        states.append(state)
    first = states[0]
    for state in states[1:]:
        if state["exact"] != first["exact"] or len(state["norms"]) != len(first["norms"]):
            return False
        pairs = zip(state["norms"], first["norms"], strict=True)
        if any(abs(x - y) > rtol * max(abs(x), abs(y)) for x, y in pairs):
            return False
    return len(sent) >= max(data["peers"] for data in sent)


def skip_state_rounds_in_agreement(opt: Any, on_skip: Any = None, local_extras: bool = False) -> None:
    """Item 16 of the module docstring, on one ``hivemind.Optimizer`` whose gradient averager this module
    built (a plain one sends no digest, and its peer never skips). ``on_skip(epoch, group)`` is told. With
    ``local_extras`` (DiLoCo: the extra tensors are each peer's inner AdamW state) agreement is judged without
    the extra tensors, and a skipped round leaves them as each peer has them."""
    averager = opt.grad_averager
    if not isinstance(averager, _KeepsLocalGradients):
        return

    def gather() -> dict[str, Any]:
        due = (opt.local_epoch + 1) % opt.average_state_every == 0
        summary = state_summary(opt, local_extras) if due else None
        return {"state": summary, "peers": opt.tracker.global_progress.num_peers}

    averager.swarm_gather = gather

    def own_results() -> tuple[int, int]:  # rounds in which this peer did not apply the group's average
        screen = getattr(opt.state_averager, "screen", None)
        return averager.local_fallbacks, screen.rejected_gradient_rounds if screen is not None else 0

    def note(gathered: Any, before: tuple[int, int]) -> int | None:
        return len(gathered) if own_results() == before and in_agreement(gathered) else None

    _skip_state_rounds_after(opt, note, on_skip, before=own_results)


def screen_rounds(opt: Any, screen: Any, on_rejected: Any, own_scale: Any = None) -> None:
    """Item 7 of the module docstring, on one ``hivemind.Optimizer`` built by this module's averagers.
    ``on_rejected(kind, reason, samples)`` is called for each rejected round (kind "gradient" or "state");
    ``own_scale()``, if given, is the factor on this peer's own gradient norm for the round being judged."""
    load, averager = opt._load_averaged_gradients_into_optimizer_, opt.grad_averager

    def load_screened() -> None:
        if averager is not None and getattr(averager, "holds_round_result", False):
            with torch.no_grad(), averager.get_tensors() as averaged:
                scale = 1.0 if own_scale is None else own_scale()
                reason = screen.judge_gradients(averaged, averager._own_grads, own_scale=scale)
            if reason is not None:
                averager.use_own_gradients()
                on_rejected("gradient", reason, averager._own_samples)
        load()

    opt._load_averaged_gradients_into_optimizer_ = load_screened
    opt.state_averager.screen, opt.state_averager.on_rejected = screen, on_rejected


@cache
def packing(base: type) -> type:
    """``base`` (one of hivemind's averager classes) averaging one buffer per dtype and role."""
    return type(base.__name__, (_PacksParts, base), {"__module__": __name__})


class _KeepsLocalGradients:
    """Mixin for hivemind's GradientAverager and its subclasses: item 2 of the module docstring."""

    local_fallbacks: int
    _own_grads: list[torch.Tensor] | None
    _own_samples: int
    _own_valid: bool

    def _swarm_init(self) -> None:
        self.local_fallbacks = 0
        self._own_grads, self._own_samples, self._own_valid = None, 0, False
        self.on_local_fallback = None  # called with the number of samples the fallback step used

    def schedule_step(self, *args: Any, **kwargs: Any) -> Any:
        # every round hivemind.Optimizer starts goes through here (optimizer.py, pre-scheduled or not)
        gather = getattr(self, "swarm_gather", None)
        if gather is not None and kwargs.get("gather") is None:
            kwargs["gather"] = gather()
        return super().schedule_step(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        # hivemind's step loads the accumulators into the averaged tensors, then (reset_accumulators=True)
        # zeroes them and starts the all-reduce, which changes the averaged tensors in place
        self._own_samples = self.local_samples_accumulated
        self._keep_own = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._keep_own = False

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        if getattr(self, "_keep_own", False) or self.local_times_accumulated > 0 or not self._own_valid:
            super().load_accumulators_into_averager_()
            if getattr(self, "_keep_own", False):
                self._remember_own()
            return
        # the accumulators were zeroed for a round that failed: use this peer's own gradient of that round
        self.use_own_gradients()
        self.local_fallbacks += 1
        if self.on_local_fallback is not None:
            self.on_local_fallback(self._own_samples)

    @property
    def holds_round_result(self) -> bool:
        """True between the end of a round that averaged this peer's gradient and the optimizer's use of it
        (the averaged tensors then hold the group's mean, and this peer's own gradient is kept)."""
        return self._own_valid

    @torch.no_grad()
    def use_own_gradients(self) -> None:
        """Put this peer's own mean gradient of the last round where the averaged one was."""
        assert self._own_grads is not None
        with self.get_tensors() as averaged:
            for mine, averaged_grad in zip(self._own_grads, averaged, strict=True):
                averaged_grad.copy_(mine)
        self._own_valid = False

    @torch.no_grad()
    def _remember_own(self) -> None:
        with self.get_tensors() as averaged:
            if self._own_grads is None:
                self._own_grads = [torch.empty_like(t) for t in averaged]
            for mine, t in zip(self._own_grads, averaged, strict=True):
                mine.copy_(t)
        self._own_valid = True

    def notify_used_averaged_gradients(self) -> None:
        self._own_valid = False  # the round's result (averaged, or this peer's own) went into the optimizer
        super().notify_used_averaged_gradients()


@cache
def keeping_local_gradients(base: type) -> type:
    """``base`` (hivemind's GradientAverager or a subclass) with item 2 of the module docstring."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _KeepsLocalGradients._swarm_init(self)
        base.__init__(self, *args, **kwargs)

    bases = (_KeepsLocalGradients, _NamesStrangers, _PacksParts, base)
    return type(base.__name__, bases, {"__init__": __init__, "__module__": __name__})


def round_averager(factory: Any) -> Any:
    """A gradient averager factory (a ``functools.partial`` of a class, as swarm/compression.py makes them)
    whose class keeps this peer's own gradients for a failed round and packs its all-reduce parts."""
    from functools import partial

    return partial(keeping_local_gradients(factory.func), *factory.args, **factory.keywords)
