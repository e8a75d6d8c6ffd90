"""hivemind.Optimizer (hivemind/optim/optimizer.py): which rounds run, what they apply, and what they skip.

**What hivemind does.** ``Optimizer.step`` accumulates local gradients; when its tracker says the swarm holds
the target batch it runs ``_update_global_epoch`` (optimizer.py:438-509): a gradient round begun by
``_begin_averaging_gradients`` (optimizer.py:511-557, pre-scheduled by ``_maybe_schedule_gradient_averaging``,
optimizer.py:559-591, when the tracker expects the epoch within ``matchmaking_time``), the averaged gradients
loaded into the optimizer (``_load_averaged_gradients_into_optimizer_``, optimizer.py:612), the update, and
the epoch's state round. A peer that fell behind downloads the newest state (``load_state_from_peers``,
optimizer.py:679-720).

**What goes wrong, and what this changes** (items of docs/hivemind-patches.md; each function below wraps
methods of one running optimizer, and :func:`wire` applies them in the order they need):

- items 5 and 10, :func:`never_cancel_rounds`: hivemind cancels a pre-scheduled round when its tracker counts
  no other peer, which can wedge the averager's matchmaking; and it skips a round altogether when the previous
  round's control is still in ``scheduled_grads``.
- item 7, :func:`screen_rounds`: every averaged gradient is judged by the peer's round screen before it is
  loaded into the optimizer; a rejected one is replaced by the peer's own gradient, and
  :func:`skip_state_rounds_after_rejection` skips that epoch's state round.
- item 11, :func:`meet_strangers_next_round`: after a round whose result names strangers
  (swarm/patches/allreduce.py), the epoch's state round is skipped, and the peer meets them in the next
  gradient round.
- item 13, :func:`download_the_epoch_it_names`: a downloaded state one epoch older than the swarm's newest
  would be numbered with the newest epoch ("Catching up with collaboration step", optimizer.py:705-707).
- item 16, :func:`skip_state_rounds_in_agreement`: a state round whose group already holds one state is
  skipped (decided from summaries sent with the gradient round's all-gather).
- item 17, :func:`number_steps_by_epoch`: AdamW's step counters follow the global epoch.
- items 24, 25 and 32, :func:`decide_downloads_after_refusals`: a donor whose state this peer refused, a
  progress record that claims an epoch no donor served, or the records of a donor that left (its dial
  failed), still set the swarm's epoch in the tracker's reads, and the peer downloaded at every step.
- item 30, :func:`leave_out_peers_that_never_came`: a gradient round that nobody else came to
  (swarm/patches/matchmaking.py ``give_up_alone``), or that some counted peers did not come to, leaves those
  peers out of the tracker's reads until they report again; before, a peer whose groupmates left waited a
  whole ``averaging_timeout`` (alone) or ``matchmaking_time`` (with others) at every epoch until their
  records expired.

hivemind 1.1.12 also never takes ``client_mode`` from the DHT (optimizer.py:205 tests ``is None`` the wrong
way round): pass it explicitly, as swarm/averaging/strategy.py does.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.patches import matchmaking, progress, robust
from swarm.patches.grad_averager import KeepsLocalGradients
from swarm.patches.state_averager import REFUSE_FOR, lock_updates

log = logging.getLogger(__name__)
AGREEMENT_RTOL = 1e-6  # item 16: figures this close count as one state (all-reduce rounding is ~1e-7)
UNSERVED_FOR = 30.0  # item 25: seconds for which a peer whose claimed epoch no donor served counts at ours


@dataclass
class Wiring:
    """What the swarm hangs on one ``hivemind.Optimizer``; see :func:`wire`."""

    update_optimizer: torch.optim.Optimizer
    """The optimizer whose ``step`` is the update: the module's AdamW, or DiLoCo's outer SGD."""
    diloco: bool = False
    """DiLoCo: no estimate of the swarm at a new epoch (each peer takes its H local steps), agreement judged
    without the extra tensors (each peer's inner AdamW state), and AdamW's counters left alone."""
    round_seconds: float = 0.0
    """DiLoCo: > 0 paces the swarm's target batch to what it computes in this many seconds
    (swarm/patches/progress.py ``pace_by_time``)."""
    report_every: float = 0.25
    """Seconds between two progress records within an epoch (0: hivemind's one per step)."""
    screen: Any = None
    """A swarm.averaging.screen.RoundScreen, or None to apply every averaged result unjudged."""
    on_rejected: Callable[[str, str, int], None] | None = None
    """Told (kind, reason, samples) of every rejected round or download."""
    own_scale: Callable[[], float] | None = None
    """The factor on this peer's own gradient norm for the round being judged (DiLoCo's short inner
    phases)."""
    instrument: Callable[[Any], Any] | None = None
    """Called with the optimizer where wrappers that time a round belong (swarm.averaging.rounds.RoundClock):
    inside those that skip a state round, so that a skipped round is not timed as one."""
    on_strangers: Callable[[int, frozenset], None] | None = None
    """Told (epoch, strangers) when a state round is skipped to meet strangers (item 11)."""
    skip_agreed_state_rounds: bool = True
    on_agreed: Callable[[int, int], None] | None = None
    """Told (epoch, group size) when a state round is skipped in agreement (item 16)."""
    on_screened_state: Callable[[int, str], None] | None = None
    """Told (epoch, reason) when a state round is skipped after the screen rejected the gradient round (item
    7)."""
    on_local_fallback: Callable[[int], None] | None = None
    """Told the samples of each step on this peer's own gradient after a failed round (item 2)."""
    check_download: Any = None
    """A swarm.averaging.donors.DonorCheck: every download is checked against the swarm's state (item 23)."""
    on_refused: Callable[[str, str], None] | None = None
    """Told (donor, reason) of every download that the screen or the check refused (item 23)."""
    download_donors: int = 1
    """With ``check_download``: a download comes in slices from up to this many donors at once (item 31)."""
    alone_grace: float = 0.0
    """> 0: a gradient or state round in which no other peer was read as looking for a group, and no follower
    came, for this many seconds fails then, not at its deadline; the peers counted in it are left out of the
    tracker's reads until they store a newer record (item 30). Not with DiLoCo."""
    on_silent: Callable[[int, int], None] | None = None
    """Told (peers left out, the round's group size, 0 if it failed) after a gradient round that some
    counted peers did not come to (item 30)."""
    members: Any = None
    """Invite-only: the run's members by signing key (a swarm.net.fence.MemberBook); the progress records
    count only under the PeerID that their signer's member record names (item 26)."""


@dataclass
class Wired:
    """What :func:`wire` left on an optimizer: ``instrument``'s result, the progress reads' state, and the
    update hooks, which :meth:`remove` takes off again."""

    instrument: Any = None
    last_read: progress.LastRead = field(default_factory=progress.LastRead)
    silent: progress.Silent | None = None
    hooks: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def wire(opt: Any, wiring: Wiring) -> Wired:
    """Apply every per-optimizer change to ``opt`` (a running ``hivemind.Optimizer`` built after
    swarm.patches.install(), with a gradient averager from swarm.patches.grad_averager), in this order.
    ``opt`` must be built from an optimizer instance, as the strategy does: built from ``params`` and an
    optimizer factory, hivemind offloads the optimizer and holds the tensor lock through its update
    (optim/state_averager.py:517), and item 4's hooks, which take the same lock, would wait forever."""
    wired = Wired()
    never_cancel_rounds(opt)  # items 5 and 10
    download_the_epoch_it_names(opt)  # item 13
    progress.throttle_progress_reports(opt.tracker, wiring.report_every)  # item 6
    if not wiring.diloco:  # item 27; innermost, so that it sees the records the wrappers below leave
        progress.count_alone_exactly(opt.tracker)
    if wiring.round_seconds > 0:  # item 22; first, so that it sees the records left after the bans
        progress.pace_by_time(opt.tracker, wiring.round_seconds)
    suspects = robust.suspects()
    if suspects is not None:  # item 21: a banned peer is not counted in this peer's swarm
        progress.leave_out_banned(opt.tracker, lambda peer: suspects.banned_for(peer) > 0)
    if wiring.alone_grace > 0 and not wiring.diloco:  # item 30
        # half the grace is matchmaking_time: a group closes without a dead peer no sooner than that after
        # its last record, while a live peer late for one round stored one within its last step
        wired.silent = progress.leave_out_silent(opt.tracker, older_than=wiring.alone_grace / 2)
        for averager in (opt.grad_averager, opt.state_averager):
            matchmaking.give_up_alone(averager, wiring.alone_grace)
        leave_out_peers_that_never_came(opt, wired.silent, wiring.on_silent)
    wired.last_read = progress.read_soon_while_speeds_unknown(opt.tracker)  # items 14 and 19
    if not wiring.diloco:  # a DiLoCo peer takes its H local steps; an estimate would cut them short
        progress.expect_the_swarm(opt.tracker, wired.last_read)  # item 15
    if wiring.screen is not None:
        screen_rounds(opt, wiring.screen, wiring.on_rejected, wiring.own_scale)  # item 7
    opt.state_averager.check_download = wiring.check_download  # item 23
    opt.state_averager.on_refused = wiring.on_refused
    opt.state_averager.download_donors = wiring.download_donors  # item 31
    keep = None
    if wiring.members is not None:  # item 26: a record speaks for the PeerID its signer's member record names
        keep = progress.vouched_by(wiring.members, opt.tracker._local_public_key)
    decide_downloads_after_refusals(opt, keep)  # items 24, 25, 32: a refused, unserved or gone epoch: no loop
    if keep is not None:  # outermost: every wrapper of the tracker's reads above sees only vouched records
        progress.keep_only(opt.tracker, keep)
    # wrappers of the same methods run outermost-last: the clock times the state round that the two below
    # may skip (a skipped round is then not timed as one), and its update hooks come before the lock's
    if wiring.instrument is not None:
        wired.instrument = wiring.instrument(opt)
    meet_strangers_next_round(opt, wiring.on_strangers)  # item 11
    if wiring.screen is not None:  # item 7: a group whose gradient round this peer rejected
        skip_state_rounds_after_rejection(opt, wiring.screen, wiring.on_screened_state)
    if wiring.skip_agreed_state_rounds:  # item 16; DiLoCo: agreement on anchors and outer momentum
        skip_state_rounds_in_agreement(opt, wiring.on_agreed, local_extras=wiring.diloco)
    wired.hooks = lock_updates(opt.state_averager, wiring.update_optimizer)  # item 4
    if not wiring.diloco:  # after the lock's hook: the counters change under the lock (item 17)
        wired.hooks.append(number_steps_by_epoch(opt.state_averager, wiring.update_optimizer))
    if isinstance(opt.grad_averager, KeepsLocalGradients):
        opt.grad_averager.on_local_fallback = wiring.on_local_fallback  # item 2
    return wired


def leave_out_peers_that_never_came(opt: Any, silent: progress.Silent, on_silent: Any = None) -> None:
    """Item 30: after a gradient round that failed because no other peer looked for a group
    (swarm/patches/matchmaking.py ``NobodyElseLooking``), or that averaged without some of the peers the
    tracker counted, ``silent`` leaves the peers that did not come out of the tracker's reads, so that the
    next epoch does not look or wait for them again. ``on_silent(count, came)`` is told how many were left
    out and how many peers the round had (0: it failed)."""
    average = opt._average_gradients_and_load_into_optimizer

    def average_noting_silent(control: Any) -> Any:
        counted = opt.tracker.global_progress.num_peers
        try:
            return average(control)
        finally:
            if control is not None and control.done() and not control.cancelled():
                came = _came_to(control)
                if isinstance(control.exception(), matchmaking.NobodyElseLooking):
                    count = silent.note()
                elif 0 < len(came) < counted:
                    count = silent.note({peer.to_base58() for peer in came})
                else:
                    count = 0
                if count and on_silent is not None:
                    on_silent(count, len(came))

    opt._average_gradients_and_load_into_optimizer = average_noting_silent


def never_cancel_rounds(opt: Any) -> None:
    """Items 5 and 10, on one ``hivemind.Optimizer`` (wraps ``_maybe_schedule_gradient_averaging`` and
    ``_begin_averaging_gradients``): a round is scheduled only when the tracker sees other peers, a round that
    was scheduled then is run rather than cancelled, and the previous round's used control is dropped before
    hivemind looks at it, so that a fresh round starts."""
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


def download_the_epoch_it_names(opt: Any, attempts: int = 3, pause: float = 0.5) -> None:
    """Item 13: make ``opt.load_state_from_peers`` (hivemind.Optimizer's, which its ``step`` also calls) leave
    the peer with the epoch number of the state it downloaded: up to ``attempts`` downloads, ``pause`` seconds
    apart, while the one downloaded is older than the epoch hivemind then moved on to (the donor that had not
    yet stepped has by then). If it is still older, the peer keeps the epoch of the state it holds, and
    hivemind's exact-epoch check has it download at its next step (optimizer.py,
    ``_should_load_state_from_peers``). A download that no donor answered because those it asked could not be
    dialled (item 32) is not repeated. Needs the state averager of swarm.patches.state_averager (its
    ``held_epoch``)."""
    load = opt.load_state_from_peers
    averager = opt.state_averager

    def load_state_from_peers(**kwargs: Any) -> Any:
        for attempt in range(1, attempts + 1):
            averager.held_epoch = None
            result = load(**kwargs)
            held = averager.held_epoch
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
            if not averager.donor_answered and averager.unreachable:
                return result  # item 32: no donor could be dialled; asking again would dial them again
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


def decide_downloads_after_refusals(opt: Any, keep: Any = None) -> None:
    """Items 24 and 25, on one ``hivemind.Optimizer`` with the swarm's state averager (its ``refused_donors``,
    each refused until ``REFUSE_FOR`` seconds after its refusal, and ``donor_answered``): the tracker's reads
    count the epoch of a refused donor, and of a peer whose epoch no donor served, as no more than this peer's
    own (swarm/patches/progress.py ``discount_refused``), and hivemind's decision to download
    (``_should_load_state_from_peers``, optimizer.py:655-673) is taken only from a read made after the last
    such discount began; before it, the step reads the swarm's progress again and does not download.

    Item 24: a peer that refused the only donor ahead of it (an honest one that ran ahead while the others
    were downloading, or one that claims a future epoch) found itself behind again at its next step,
    downloaded from the donors at its own epoch, and again: in a 4-peer swarm on 127.0.0.1, three peers did
    so for two minutes while the fourth stepped alone.

    Item 25: a progress record may claim any epoch (a peer that is no donor, or serves an older state than it
    claims). hivemind downloads from the newest donor, keeps that state, finds itself behind the claim again
    and downloads at every step. Once a donor answered a download (its state arrived and stands, applied or
    older than this peer's own) and this peer is still more than one epoch behind the swarm's epoch, the
    records are read again, and the peer of each record still more than one epoch ahead is counted at this
    peer's epoch for ``UNSERVED_FOR`` seconds (one epoch behind is left to item 13: a donor that stepped while
    this peer downloaded); a download that no donor answered marks nobody, so a newcomer still downloads until
    it holds the swarm's state. A warning names a claimer only where its claim is known false (it declares no
    state, or this peer asked it and it served an older state than it claimed as the download began); a
    claimer that declares itself a donor and was not asked may be honest (its declaration lags, item 18, or it
    stepped on during the download): one line of news for all such.

    Item 32: a download that could not dial a donor (``averager.unreachable``: it left, with its records
    still in the DHT), or that a donor refused because it bans this peer, counts the claim of each such peer
    ahead of this one at this peer's epoch for ``UNSERVED_FOR`` seconds, whether or not another donor
    answered."""
    averager, tracker = opt.state_averager, opt.tracker
    unserved: dict[str, float] = {}  # item 25: peer (base58) -> until (time.monotonic)
    marked = [-math.inf]  # when unserved claims were last marked

    def discounted(peer: str) -> bool:
        now = time.monotonic()
        return averager.refused_donors.get(peer, -math.inf) > now or unserved.get(peer, -math.inf) > now

    reads = progress.discount_refused(tracker, discounted)
    should_load, load = opt._should_load_state_from_peers, opt.load_state_from_peers

    def should_load_from_a_read_after_the_discounts() -> bool:
        last = max([until - REFUSE_FOR for until in averager.refused_donors.values()] + marked)
        if last == -math.inf:  # no discount ever
            return should_load()
        # the tracker reads and sets its epoch under this lock: holding it, the epoch that hivemind judges is
        # the one of the read whose time is checked (a read in flight: the next step decides)
        if not tracker.lock_global_progress.acquire(blocking=False):
            return False
        try:
            if not should_load():
                return False
            if reads.at > last:  # no discount began since the read
                return True
        finally:
            tracker.lock_global_progress.release()
        progress.read_within(tracker, 0.0)  # the next step decides from the new read
        return False

    def load_marking_unserved_claims(**kwargs: Any) -> Any:
        # the claims of the read that sent this peer to download (read now if no read was seen yet: the
        # tracker's first read, at its creation, comes before this wrapper)
        before = reads.claims() or progress.claimed_epochs(tracker, keep=keep)
        result = load(**kwargs)
        held = opt.local_epoch
        # one epoch ahead: a donor that stepped while this peer downloaded (item 13 downloads again)
        behind = averager.donor_answered and tracker.global_epoch > held + 1
        if not behind and not averager.unreachable:
            return result
        claims = progress.claimed_epochs(tracker, keep=keep)  # read once, for items 32 and 25
        mark_unreachable(held, claims)
        if not behind:
            return result
        ahead = {peer: epoch for peer, epoch in claims.items() if epoch > held + 1 and not discounted(peer)}
        if not ahead:
            return result
        donors, moved_on = averager.declared_donors(), []
        now = time.monotonic()
        unserved.update((peer, now + UNSERVED_FOR) for peer in ahead)
        # marked after the discounts are in place: a read that began later has applied them
        marked[0] = time.monotonic()
        for peer, epoch in ahead.items():
            # blamed only where the claim is known false: no donor record, or this peer asked it and it served
            # an older state than it claimed as the download began
            served_less = peer == averager.answered_by and before.get(peer, -math.inf) > held + 1
            if peer in donors and not served_less:
                moved_on.append(epoch)
                continue
            why = (
                "this peer asked it, and it served an older state"
                if served_less
                else f"it serves no state (epoch {held} is the newest that its donors served)"
            )
            log.warning(
                "Peer %s claims global epoch %d, but %s: this peer counts it at its own epoch for %.0f s "
                "instead of downloading again",
                peer,
                epoch,
                why,
                UNSERVED_FOR,
            )
        if moved_on:
            log.info(
                "%d donor(s) that this download did not ask, or that stepped on while it ran, are at global "
                "epochs up to %d, past the state of epoch %d that it got: this peer counts them at its own "
                "epoch for %.0f s and meets them in its rounds instead of downloading again",
                len(moved_on),
                max(moved_on),
                held,
                UNSERVED_FOR,
            )
        return result

    def mark_unreachable(held: int, claims: dict[str, int]) -> None:
        # item 32: a donor that this download could not dial left (or moved) with its records still in the
        # DHT; its claim ahead would send this peer to download, and dial it, at every step until they expire.
        # So would one that refuses this peer because it bans it (an attacker bans the honest peers it
        # judges, and its groups without them run ahead): it serves nobody it bans until its ban ends
        gone = averager.unreachable
        ahead = {p: e for p, e in claims.items() if p in gone and e > held and not discounted(p)}
        if not ahead:
            return
        unserved.update((peer, time.monotonic() + UNSERVED_FOR) for peer in ahead)
        marked[0] = time.monotonic()
        log.info(
            "%d peer(s) ahead of this one, at global epochs up to %d, could not be dialled for a download "
            "(they left, or their address changed) or refused it (they ban this peer): this peer counts them "
            "at its own epoch %d for %.0f s",
            len(ahead),
            max(ahead.values()),
            held,
            UNSERVED_FOR,
        )

    opt._should_load_state_from_peers = should_load_from_a_read_after_the_discounts
    opt.load_state_from_peers = load_marking_unserved_claims


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
    """Item 11, on one ``hivemind.Optimizer``: after a gradient round whose result names strangers, that
    epoch's state round is skipped. ``on_skip(epoch, strangers)`` is told."""
    _skip_state_rounds_after(opt, lambda gathered, _: getattr(gathered, "strangers", None) or None, on_skip)


def skip_state_rounds_after_rejection(opt: Any, screen: Any, on_skip: Any = None) -> None:
    """Item 7, on one ``hivemind.Optimizer`` wired with :func:`screen_rounds` (wrap after it): after a
    gradient round that ``screen`` rejected, the epoch's state round is skipped and the peer keeps its own
    state. Colluders that are half of a group or more own its robust result, of its state round as of its
    gradient round, and the screen catches only the gradient: in the attack bench (x-8, two colluders of
    five), an honest peer whose gradient round with both was rejected took their parameters in the same
    epoch's state round, 0.023 of its norm away (within ``STATE_RADIUS``), and its val acc fell from 0.83 to
    their 0.33. ``on_skip(epoch, reason)`` is told."""

    def rejected() -> int:
        return int(screen.rejected_gradient_rounds)

    _skip_state_rounds_after(
        opt, lambda _, before: "rejected" if rejected() > before else None, on_skip, before=rejected
    )


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
        # and the optimizer's state that the round does not average but the next update reads (momentum
        # buffers outside average_opt_statistics). Left out, peers that agreed on the anchors took outer steps
        # with different momenta and parted right after every skipped round
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
    if getattr(gathered, "received", 1.0) < 1:  # a partial round: this peer kept some of its own numbers
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
    """Item 16, on one ``hivemind.Optimizer`` whose gradient averager swarm.patches.grad_averager built (a
    plain one sends no summary, and its peer never skips). ``on_skip(epoch, group)`` is told. With
    ``local_extras`` (DiLoCo: the extra tensors are each peer's inner AdamW state) agreement is judged without
    the extra tensors, and a skipped round leaves them as each peer has them."""
    averager = opt.grad_averager
    if not isinstance(averager, KeepsLocalGradients):
        return

    def gather() -> dict[str, Any]:
        due = (opt.local_epoch + 1) % opt.average_state_every == 0
        summary = state_summary(opt, local_extras) if due else None
        return {"state": summary, "peers": opt.tracker.global_progress.num_peers}

    averager.gather_hook = gather

    def own_results() -> tuple[int, int]:  # rounds in which this peer did not apply the group's average
        screen = getattr(opt.state_averager, "screen", None)
        return averager.local_fallbacks, screen.rejected_gradient_rounds if screen is not None else 0

    def note(gathered: Any, before: tuple[int, int]) -> int | None:
        return len(gathered) if own_results() == before and in_agreement(gathered) else None

    _skip_state_rounds_after(opt, note, on_skip, before=own_results)


def screen_rounds(opt: Any, screen: Any, on_rejected: Any, own_scale: Any = None) -> None:
    """Item 7, on one ``hivemind.Optimizer`` built with this package's averagers. ``on_rejected(kind, reason,
    samples)`` is called for each rejected round (kind "gradient", "state" or "download"); ``own_scale()``, if
    given, is the factor on this peer's own gradient norm for the round being judged."""
    load, averager = opt._load_averaged_gradients_into_optimizer_, opt.grad_averager
    average = opt._average_gradients_and_load_into_optimizer
    round_control: list[Any] = [None]
    far_seen: dict[str, int] = {}  # per groupmate: its far rounds counted when last in a round with this peer

    def average_keeping(control: Any) -> Any:
        round_control[0] = control
        try:
            return average(control)
        finally:
            round_control[0] = None

    def load_screened() -> None:
        if isinstance(averager, KeepsLocalGradients) and averager.holds_round_result:
            group = _group_of(round_control[0])
            with torch.no_grad(), averager.get_tensors() as averaged:
                scale = 1.0 if own_scale is None else own_scale()
                reason = screen.judge_gradients(
                    averaged, averager.own_gradients, own_scale=scale, group_size=len(group) or None
                )
                # gradients, not DiLoCo's pseudo-gradients, where the strategy gave the screen a probe
                if reason is None and own_scale is None and screen.probe is not None:
                    params = list(opt.state_averager.main_parameters)
                    optimizer = opt.state_averager.optimizer
                    reason = screen.judge_step(params, averaged, averager.own_gradients, optimizer)
            if len(group) == 2:  # the robust rule cannot judge the other of two: this screen does
                _judge_other(group, opt.dht.peer_id, screen.pair_scale)
            elif len(group) > 2:  # groupmates whose parts lay far from this peer's, in a round it rejects
                _judge_far(group, opt.dht.peer_id, screen, reason is not None, far_seen)
            if reason is not None:
                averager.use_own_gradients()
                on_rejected("gradient", reason, averager.own_samples)
        load()

    opt._average_gradients_and_load_into_optimizer = average_keeping
    opt._load_averaged_gradients_into_optimizer_ = load_screened
    opt.state_averager.screen, opt.state_averager.on_rejected = screen, on_rejected


def _group_of(control: Any) -> list[Any]:
    """The PeerIDs of the group of a finished round (hivemind's StepControl: its result is what each member
    sent with the all-gather, by PeerID); empty if unknown."""
    try:
        if control is not None and control.done() and not control.cancelled() and not control.exception():
            return list(control.result())
    except Exception:
        pass
    return []


def _came_to(control: Any) -> list[Any]:
    """The PeerIDs of a finished round's group and of the strangers its result names (item 11): those were
    taken into the group, then dropped from its all-reduce, and wait for this peer in their next gradient
    round, so they came (left out, they were not met there). Empty if unknown."""
    group = _group_of(control)
    return group + list(getattr(control.result(), "strangers", ())) if group else []


def _judge_far(group: list[Any], own: Any, screen: Any, rejected: bool, seen: dict[str, int]) -> None:
    """A round of three or more (swarm/suspects.py, "far, in a round the screen rejects"): each groupmate
    whose parts this peer's reducer noted far from its own in this round gets a judged round, scored by the
    average's distance as in a round of two, when the screen rejected the round for that distance. ``seen``
    keeps each groupmate's count of far rounds from its last round with this peer, so a count that grew since
    came from this round."""
    suspects = robust.suspects()
    if suspects is None:
        return
    far = rejected and screen.last_distance > screen.radius
    scale = screen.scale_at(screen.last_distance)
    for peer in group:
        if peer == own:
            continue
        name = str(peer)
        count = suspects.far_rounds(name)
        if far and count > seen.get(name, 0):
            suspects.record(name, scale)
        seen[name] = count


def _judge_other(group: list[Any], own: Any, scale: float) -> None:
    """A round of two, judged by the screen: one judged round of the other, scaled by ``scale``
    (swarm/suspects.py)."""
    suspects = robust.suspects()
    if suspects is not None:
        for peer in group:
            if peer != own:
                suspects.record(str(peer), scale)


def number_steps_by_epoch(state_averager: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Item 17: before each update, every ``step`` counter in ``optimizer``'s state is set to the global epoch
    the update comes from; returns the hook. Register it after :func:`lock_updates`' hooks, so that it runs
    under the tensor lock."""

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
