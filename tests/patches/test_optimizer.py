"""What swarm/patches/optimizer.py changes on one hivemind.Optimizer: rounds never cancelled (item 5) or
skipped (item 10), judged gradients (item 7), strangers met in the next round (item 11), downloads numbered
with their epoch (item 13), agreed state rounds skipped (item 16), AdamW's counters by epoch (item 17), and
the order in which ``wire`` applies them. Each test runs one scenario on plain hivemind (the change not
applied) and with the change."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging.diloco import DiLoCo
from swarm.averaging.rounds import RoundClock
from swarm.averaging.screen import RoundScreen, total_norm
from swarm.patches import allreduce, grad_averager, matchmaking, progress
from swarm.patches import optimizer as wiring
from swarm.waiting import wait_until
from tests.patches.common import (
    MATCHMAKING,
    PLAIN_OR_PATCHED,
    _assert_a_holds,
    _gradients,
    _screened_round,
    _state_averagers,
)
from tests.patches.common import _screened_gradient_pair as _shared_screened_pair

MATCHMAKING_TIME, AVERAGING_TIMEOUT = 0.5, 2.0  # a lone peer's rounds: looking from 0.5 s, failed at 2 s
# two peers' rounds: a follower waits this long for its leader's answer. Far below MATCHMAKING (the group
# closes when full), and far above a starved process's pause on a loaded 2-core machine, which would make
# the follower give up on a leader that took it (item 8) and the round end without it
REQUEST_TIMEOUT = 5.0


def _screened_gradient_pair(dhts, prefix: str, own_scale: Any = None):
    """tests.patches.common._screened_gradient_pair with REQUEST_TIMEOUT."""
    return _shared_screened_pair(dhts, prefix, own_scale, request_timeout=REQUEST_TIMEOUT)


@contextmanager
def _lone_optimizer(
    node: hivemind.DHT, run: str, optimizer: Any = None, chunk_timeout: float | None = None
) -> Iterator[hivemind.Optimizer]:
    """A hivemind.Optimizer on ``node`` built as swarm/averaging/strategy.py builds it: around an optimizer
    of the module's parameters (``optimizer`` of them; SGD, lr 1, by default), so that hivemind runs the
    update on them without the tensor lock (no offloading, ``reuse_tensors`` False), with the swarm's
    gradient averager; and short rounds: a round pre-scheduled with nobody to find fails at
    AVERAGING_TIMEOUT. ``chunk_timeout`` is hivemind's ``next_chunk_timeout`` (by default its
    matchmaking_time, 0.5 s here), the wait for each chunk of a download as of an all-reduce."""
    net = torch.nn.Linear(4, 3)
    opt = hivemind.Optimizer(
        dht=node,
        run_id=run,
        optimizer=(optimizer or partial(torch.optim.SGD, lr=1.0))(net.parameters()),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        next_chunk_timeout=chunk_timeout,
        averager_opts={"request_timeout": 1.0},
        delay_state_averaging=False,  # as swarm/averaging/strategy.py: the epoch's state round is awaited
        grad_averager_factory=grad_averager.round_averager(partial(GradientAverager, request_timeout=1.0)),
    )
    try:
        yield opt
    finally:
        opt.scheduled_grads = None  # each test ends its rounds itself (see the item 10 test)
        opt.shutdown()


@contextmanager
def _optimizer_beside_a_tracker(dhts, run: str, optimizer: Any = None) -> Iterator[hivemind.Optimizer]:
    """A lone optimizer (above) whose tracker counts two peers from real reads: its own record and that of a
    peer B that only reports progress (a tracker on a second node with its own key, as a peer that computes
    its samples)."""
    node_a, node_b = dhts(2)
    b = ProgressTracker(node_b, run, target_batch_size=8, private_key=RSAPrivateKey(), start=True)
    try:
        b.report_local_progress(0, 1)
        with _lone_optimizer(node_a, run, optimizer) as opt:
            opt.tracker.report_local_progress(0, 4)  # its own record: stored once it has samples

            def both_seen() -> bool:
                if opt.tracker.global_progress.num_peers == 2:
                    return True
                progress.read_within(opt.tracker, 0.0)  # read again now
                return False

            assert wait_until(both_seen, timeout=20, interval=0.1), opt.tracker.global_progress
            yield opt
    finally:
        b.shutdown()


def _a_round_that_names_a_stranger(opt: hivemind.Optimizer) -> Future:
    """Make ``opt``'s next gradient round end at once with the result of a round in which groupmate C never
    learnt of the group (swarm/patches/allreduce.py names it a stranger, item 11): hivemind's
    ``_begin_averaging_gradients`` gets this control from ``grad_averager.step``."""
    control: Future = Future()
    control.set_result(allreduce.Gathered.without({"a": None, "b": None, "c": None}, {"c"}))
    control.triggered = True  # type: ignore[attr-defined]  # as a StepControl whose all-reduce was allowed
    opt.grad_averager.step = lambda **kwargs: control
    return control


@PLAIN_OR_PATCHED
def test_a_round_scheduled_while_other_peers_were_seen_is_run_not_cancelled(dhts, patched):
    """Item 5. hivemind.Optimizer pre-schedules a gradient round when its tracker expects the epoch within
    ``matchmaking_time``, even with no other peer (optim/optimizer.py:559-567), and at the epoch's end cancels
    a pre-scheduled round that is still looking for its group when the tracker counts no other peer
    ("Skipping pre-scheduled averaging round: there are no other peers", optimizer.py:539-542). Here both
    cancels land while the averager process looks for a group (the case that wedged a demo peer's
    matchmaking). With never_cancel_rounds nothing is scheduled alone, and a round scheduled while another
    peer was seen runs: with its peer gone it fails at its deadline. The tracker's counts are set under its
    lock, as a read would leave them (hivemind holds that lock for the epoch's end)."""
    (node,) = dhts(1)
    with _lone_optimizer(node, f"pytest-rounds-cancel-{patched}") as opt:
        if patched:
            wiring.never_cancel_rounds(opt)
        seen: dict[str, tuple] = {}
        with opt.tracker.pause_updates():
            opt.tracker.global_progress.eta_next_epoch = get_dht_time()  # the epoch is due: schedule now
            for case, (when_scheduled, at_the_end) in {"alone": (1, 1), "peer left": (2, 1)}.items():
                opt.tracker.global_progress.num_peers = when_scheduled
                opt._maybe_schedule_gradient_averaging()
                control = opt.scheduled_grads
                if control is None:
                    seen[case] = (None,)
                    continue
                looking = wait_until(lambda c=control: c.stage == AveragingStage.LOOKING_FOR_GROUP, 10)
                opt.tracker.global_progress.num_peers = at_the_end
                began = opt._begin_averaging_gradients(None)
                seen[case] = (bool(looking), began, control.cancelled())
                if began:  # the round runs with nobody to find: it fails at its deadline, not cancelled
                    assert control.triggered  # its all-reduce is allowed
                    assert wait_until(control.done, timeout=AVERAGING_TIMEOUT + 10), control.stage
                    assert not control.cancelled() and control.exception() is not None
                opt.scheduled_grads = None
    # (looking for a group when the epoch ended, began a round, cancelled); (None,): nothing scheduled
    if patched:
        assert seen == {"alone": (None,), "peer left": (True, True, False)}, seen
    else:
        assert seen == {"alone": (True, False, True), "peer left": (True, False, True)}, seen


@PLAIN_OR_PATCHED
def test_a_round_starts_when_the_last_ones_control_is_still_there(dhts, patched):
    """Item 10. The last epoch's round was pre-scheduled (optim/optimizer.py:559-567) and ran; this epoch's
    was not (the swarm was ready sooner than estimated), so hivemind.Optimizer still holds the last round's
    control in ``scheduled_grads``: ``_begin_averaging_gradients`` drops it as "already used elsewhere"
    (optimizer.py:518-524) and starts no round at all, since the fresh round is in the ``elif`` it no longer
    reaches (optimizer.py:526-533): the peer steps alone while its groupmates wait for it until
    averaging_timeout. With never_cancel_rounds a fresh round starts. The tracker counts two peers from real
    reads."""
    with _optimizer_beside_a_tracker(dhts, f"pytest-rounds-used-{patched}") as opt:
        if patched:
            wiring.never_cancel_rounds(opt)
        with opt.tracker.pause_updates():  # as at an epoch's end
            opt.tracker.global_progress.eta_next_epoch = (
                get_dht_time()
            )  # the last epoch was due: pre-scheduled
            opt._maybe_schedule_gradient_averaging()
            last = opt.scheduled_grads
            assert last is not None and opt._begin_averaging_gradients(None) and opt.scheduled_grads is last
            assert wait_until(last.done, timeout=AVERAGING_TIMEOUT + 10), last.stage  # B runs no averager
            began = opt._begin_averaging_gradients(None)  # this epoch's, nothing pre-scheduled
            fresh = opt.scheduled_grads
        started = began and fresh is not None and fresh is not last and fresh.triggered
        if fresh is not None and fresh is not last and not fresh.done():
            # a round hivemind starts itself has no deadline (GradientAverager.step without a timeout):
            # cancelled here, and not again by opt.shutdown(): a second cancel of a control whose stage the
            # averager process has not yet moved on raises InvalidStateError (a fresh-clone suite)
            fresh.cancel()
        assert started == patched, (began, fresh, last)
        if not patched:
            assert fresh is None  # hivemind dropped the last control and started nothing


@PLAIN_OR_PATCHED
def test_an_outsized_averaged_gradient_is_rejected_for_the_peers_own(dhts, patched):
    """Item 7 for gradients. In the first round B is honest and A applies the exact mean; in the second B's
    gradient is 10,000 times too large. Plain hivemind copies whatever the round averaged into the optimizer
    (optim/optimizer.py:612-630, ``_load_averaged_gradients_into_optimizer_``): A then holds the mean, 7,418
    times its own gradient's norm. With screen_rounds A's screen puts A's own gradient where the mean was,
    counts the round and says why. Both peers run the swarm's averagers (a plain hivemind GradientAverager
    cannot average with the swarm's packed parts at all: its round fails with "received 0.0% results")."""
    with _screened_gradient_pair(dhts, f"pytest-rounds-screen-{patched}") as pair:
        nets, averagers, screened, screen, rejected, loaded = pair
        if not patched:  # hivemind's own loading, with no screen before it
            plain = SimpleNamespace(_load_averaged_gradients_into_optimizer_=lambda: loaded.append(True))
            pair = (nets, averagers, plain, screen, rejected, loaded)
        own, theirs = _screened_round(pair, (1.0, 4), (1.0, 4), seed=0, b_seed=10)
        _assert_a_holds(pair, [(g + h) / 2 for g, h in zip(own, theirs, strict=True)])
        own, theirs = _screened_round(pair, (1.0, 4), (1e4, 4), seed=1, b_seed=11)
        assert len(loaded) == 2  # hivemind's own loading ran (after the screen, if any), both times
        if not patched:
            mean = [(g + h) / 2 for g, h in zip(own, theirs, strict=True)]
            assert total_norm(mean) / total_norm(own) == pytest.approx(7418, rel=1e-3)
            _assert_a_holds(pair, mean)  # applied unchecked
            assert not rejected and screen.rejected_gradient_rounds == 0 and not screen.norms
            return
        _assert_a_holds(pair, own)
        assert screen.rejected_gradient_rounds == 1 and len(screen.norms) == 1, screen.__dict__
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 4, rejected
        assert "x this peer's reference" in reason and "the limit is 10x" in reason, reason


def test_a_diloco_peer_after_one_inner_step_accepts_the_mean_of_peers_that_took_sixteen(dhts):
    """A DiLoCo newcomer joins its first outer round after 1 inner step while B took 16 (H = 16): B's
    pseudo-gradient is 16 times A's, and the mean weighted by samples (1 and 16 batches) is 257/17 = 15.1
    times A's own, past the screen's 10x. Scaled by H / steps taken (DiLoCo.pseudo_gradient_scale), A
    accepts that honest mean; B 10,000 times too large is still rejected. Without the scale A rejected the
    first round (seen in the DiLoCo test's summaries: ``rejected: ['gradient']``)."""
    inner = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    diloco = DiLoCo(inner, local_steps=16, outer_lr=0.7, outer_momentum=0.9)
    diloco.sent_steps = 1  # the steps behind the pseudo-gradient in the round
    assert diloco.pseudo_gradient_scale() == 16.0
    with _screened_gradient_pair(dhts, "pytest-rounds-diloco-screen", diloco.pseudo_gradient_scale) as pair:
        *_, screen, rejected, loaded = pair
        own, theirs = _screened_round(pair, (1.0, 1), (16.0, 16), seed=0, b_seed=0)  # one direction
        mean = [(g + 16 * h) / 17 for g, h in zip(own, theirs, strict=True)]
        assert 15 < total_norm(mean) / total_norm(own) < 15.2  # what the unscaled screen rejected
        _assert_a_holds(pair, mean)
        assert not rejected and screen.rejected_gradient_rounds == 0, rejected
        own, _ = _screened_round(pair, (1.0, 1), (1.6e5, 16), seed=1, b_seed=1)
        _assert_a_holds(pair, own)
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 1 and "x 16" in reason, rejected
        assert len(loaded) == 2


@PLAIN_OR_PATCHED
def test_in_a_round_of_two_a_gradient_far_from_the_peers_own_is_rejected(dhts, patched):
    """Item 7 in a round of two, where no robust rule can outvote the other peer (swarm/patches/robust.py
    gives the plain mean of two). First B is honest (another batch's gradient): A applies the mean. Then B
    sends A's own gradient times -8: the mean, -3.5 times A's gradient, is within the screen's 10x, and plain
    hivemind applies it. With the screen A rejects it (it lies 4.5 times A's reference from A's own
    gradient), steps on its own gradient, and counts a clipped round of B (swarm/suspects.py)."""
    from swarm.patches import robust

    with _screened_gradient_pair(dhts, f"pytest-rounds-pair-{patched}") as pair:
        nets, (a, b), screened, screen, rejected, loaded = pair
        if not patched:  # hivemind's own loading, with no screen before it
            plain = SimpleNamespace(_load_averaged_gradients_into_optimizer_=lambda: loaded.append(True))
            pair = (nets, (a, b), plain, screen, rejected, loaded)
        else:
            robust.suspects().clear()
        own, theirs = _screened_round(pair, (1.0, 4), (1.0, 4), seed=3, b_seed=13)
        _assert_a_holds(pair, [(g + h) / 2 for g, h in zip(own, theirs, strict=True)])
        own, theirs = _screened_round(pair, (1.0, 4), (-8.0, 4), seed=4, b_seed=4)  # B: A's gradient x -8
        mean = [(g + h) / 2 for g, h in zip(own, theirs, strict=True)]
        assert total_norm(mean) / total_norm(own) == pytest.approx(3.5, rel=1e-4)
        if not patched:
            _assert_a_holds(pair, mean)  # applied: a step uphill, 3.5 times as long as A's own
            assert not rejected
            return
        _assert_a_holds(pair, own)
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 4, rejected
        assert "in a round of two" in reason and "4.5x this peer's reference" in reason, reason
        (suspect,) = robust.suspects().suspects()
        assert suspect.peer == str(b.peer_id) and (suspect.rounds, suspect.clipped) == (2, 1), suspect
        assert suspect.banned_for == 0


@PLAIN_OR_PATCHED
def test_a_round_that_names_a_stranger_skips_the_epochs_state_round(dhts, patched):
    """Item 11. A gradient round ends naming groupmate C a stranger (it never learnt of the group), and the
    epoch ends as hivemind.Optimizer ends it (``_update_global_epoch``), with two peers counted. Plain
    hivemind holds the epoch's state round whatever the gradient round found (``averaging_round=
    should_average_state``, optim/optimizer.py:463-490): this peer looks for a state group until
    averaging_timeout, while the stranger still looks for it in gradient matchmaking. With
    meet_strangers_next_round the state round is skipped and the peer goes on to the next gradient round."""
    with _optimizer_beside_a_tracker(dhts, f"pytest-rounds-strangers-{patched}") as opt:
        state_steps: list[tuple[bool, float]] = []  # what reached hivemind's state averager, and its time
        state_step = opt.state_averager.step

        def recorded(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return state_step(*args, **kwargs)
            finally:
                if kwargs.get("increment_epoch"):
                    state_steps.append((kwargs.get("averaging_round"), time.monotonic() - began))

        opt.state_averager.step = recorded
        told: list[tuple] = []
        if patched:
            wiring.meet_strangers_next_round(opt, lambda *args: told.append(args))
        _a_round_that_names_a_stranger(opt)
        opt._update_global_epoch(None)
        assert opt.local_epoch == 1
        ((held, seconds),) = state_steps
    if patched:
        assert not held and told == [(1, frozenset({"c"}))], (state_steps, told)
    else:  # held, and it looked for a state group (nobody else's state averager) until its deadline
        assert held and seconds >= AVERAGING_TIMEOUT - 0.1 and not told, (state_steps, told)


@PLAIN_OR_PATCHED
def test_a_gradient_round_the_screen_rejects_skips_the_epochs_state_round(dhts, patched):
    """Item 7. A gradient round of three ends with an average eight times this peer's own gradient the other
    way (two colluders that own the group): the screen rejects it and the peer steps on its own gradient.
    Without skip_state_rounds_after_rejection the epoch's state round is still held (with the same colluders
    it would hand the peer their parameters); with it, the state round is skipped and told."""
    with _optimizer_beside_a_tracker(dhts, f"pytest-rounds-rejected-{patched}") as opt:
        state_steps: list[bool] = []
        state_step = opt.state_averager.step

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("increment_epoch"):
                state_steps.append(kwargs.get("averaging_round"))
            return state_step(*args, **kwargs)

        opt.state_averager.step = recorded
        screen, rejected, told = RoundScreen(), [], []
        wiring.screen_rounds(opt, screen, lambda *args: rejected.append(args))
        if patched:
            wiring.skip_state_rounds_after_rejection(opt, screen, lambda *args: told.append(args))
        control: Future = Future()
        control.set_result(allreduce.Gathered.without({"a": None, "b": None, "c": None}, set()))
        control.triggered = True  # type: ignore[attr-defined]
        averager = opt.grad_averager
        with torch.no_grad(), averager.get_tensors() as averaged:
            own = [torch.ones_like(t) for t in averaged]
            for tensor, mine in zip(averaged, own, strict=True):
                tensor.copy_(-8 * mine)  # the round's result
        averager._own_grads, averager._own_valid = own, True  # this peer's own gradient of the round
        opt.grad_averager.step = lambda **kwargs: control
        opt._update_global_epoch(None)
        assert opt.local_epoch == 1 and len(rejected) == 1 and rejected[0][0] == "gradient", rejected
        assert all(float(p.grad.sum()) > 0 for p in opt.state_averager.main_parameters), "steps on its own"
    if patched:
        assert state_steps == [False] and told == [(1, "rejected")], (state_steps, told)
    else:
        assert state_steps == [True] and not told, (state_steps, told)


def test_wire_applies_the_changes_in_the_order_they_need(dhts):
    """``wire`` with a RoundClock as the instrument (as swarm/averaging/strategy.py wires it), over one epoch
    whose gradient round names a stranger: the clock sits inside the wrappers that skip a state round, so the
    skipped round is not timed as a state round (a clock applied after wire, outermost, times it), and the
    clock's update hooks come before the tensor lock's (its update time includes the wait for the lock, as
    a donor copying the state holds it), with AdamW's counters numbered after the lock is taken (item 17). The
    lock is held here while the epoch's update waits for it."""
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    with _optimizer_beside_a_tracker(dhts, "pytest-rounds-wire", adamw) as opt:
        update = opt.state_averager.optimizer
        told: list[tuple] = []
        wired = wiring.wire(
            opt,
            wiring.Wiring(
                update_optimizer=update,
                instrument=lambda o: RoundClock(o, update),
                on_strangers=lambda *args: told.append(args),
            ),
        )
        clock, outer = wired.instrument, RoundClock(opt, update)
        try:
            counters = [state["step"] for state in update.state.values()]
            for counter in counters:
                counter.fill_(7.0)  # a peer that ran 7 updates
            _a_round_that_names_a_stranger(opt)
            epoch = threading.Thread(target=opt._update_global_epoch, args=(None,), daemon=True)
            with opt.state_averager.lock_averaged_tensors:
                epoch.start()
                assert wait_until(lambda: clock._update_started, timeout=20, interval=0.01)
                assert not outer._update_started  # registered after the lock's hook: waits for the lock
                assert {float(c) for c in counters} == {7.0}  # numbered only once the lock is taken
                waited_from, released = clock._update_started, time.perf_counter()  # released just after
            epoch.join(timeout=30)
            assert not epoch.is_alive()
            assert opt.local_epoch == 1 and {float(c) for c in counters} == {1.0}
            assert told == [(1, frozenset({"c"}))], told
            assert clock.strangers == 1 and clock.parts["state"] == 0.0, clock.parts  # skipped: not timed
            assert outer.parts["state"] > 0.0, outer.parts  # outside the skipping wrappers: timed as one
            assert clock.parts["update"] >= released - waited_from, clock.parts  # the wait for the lock too
            assert outer.parts["update"] > 0.0, outer.parts
        finally:
            outer.close()
            wired.remove()
            wired.instrument.close()


@PLAIN_OR_PATCHED
def test_a_state_round_is_skipped_only_when_the_whole_group_sent_one_state(dhts, patched):
    """Item 16 on real averagers: A and B each hold the swarm's gradient averager and state averager over a
    net, with equal nets. Plain hivemind runs the state round of every epoch (optim/optimizer.py:463-490,
    ``averaging_round=should_average_state``), though the group averages equal tensors. With
    skip_state_rounds_in_agreement their gradient rounds carry each one's state digest and tracker count in
    hivemind's all-gather: equal nets, both skip the epoch's state round. Then B's weight moved by 1e-3: both
    hold it. Equal again, but B's tracker counts a third peer that is not in the group: both hold it. The
    state steps are recorded with what hivemind.Optimizer would pass, not run."""
    nodes = dhts(2)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    states = _state_averagers(nodes, nets, f"pytest-rounds-agree-state-{patched}")
    prefix = f"pytest-rounds-agree-{patched}"
    common = dict(
        prefix=prefix, min_matchmaking_time=MATCHMAKING, request_timeout=REQUEST_TIMEOUT, start=True
    )
    grads = [
        grad_averager.keeping_local_gradients(GradientAverager)(list(net.parameters()), dht=node, **common)
        for net, node in zip(nets, nodes, strict=True)
    ]
    held: list[list[dict]] = [[], []]  # each peer's state steps: their keyword arguments
    skipped: list[list[tuple]] = [[], []]
    opts = []
    for i in range(2):
        states[i].step = lambda *args, _i=i, **kwargs: held[_i].append(kwargs)
        opt = SimpleNamespace(
            local_epoch=0,
            average_state_every=1,
            grad_averager=grads[i],
            state_averager=states[i],
            tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=2)),
            _average_gradients_and_load_into_optimizer=lambda control: control.result(timeout=MATCHMAKING),
        )
        if patched:
            wiring.skip_state_rounds_in_agreement(opt, lambda *args, _i=i: skipped[_i].append(args))
        opts.append(opt)

    def one_round() -> list[bool]:
        """A gradient round of both, then each one's epoch step as hivemind.Optimizer calls it: whether
        the state round was held, per peer."""
        for net, averager, seed in zip(nets, grads, (0, 1), strict=True):
            _gradients(net, 1.0, seed=seed)
            averager.accumulate_grads_(batch_size=4)
        controls = [averager.step(wait=False, timeout=MATCHMAKING + 10) for averager in grads]
        for opt, control in zip(opts, controls, strict=True):
            assert len(opt._average_gradients_and_load_into_optimizer(control)) == 2
        for opt, averager in zip(opts, grads, strict=True):
            opt.state_averager.step(
                increment_epoch=True, optimizer_step=True, averaging_round=True, averaging_opts={"timeout": 9}
            )
            averager.notify_used_averaged_gradients()
        return [h.pop()["averaging_round"] for h in held]

    try:
        for averager in grads:
            matchmaking.set_target_group_size(averager, 2, {})
        assert wiring.state_summary(opts[0]) == wiring.state_summary(opts[1])
        if not patched:
            assert one_round() == [True, True]  # equal states, averaged all the same
            assert skipped == [[], []]
            return
        assert one_round() == [False, False]
        assert skipped == [[(1, 2)], [(1, 2)]], skipped
        with torch.no_grad():
            nets[1].weight[0, 0] += 1e-3
        assert wiring.state_summary(opts[0]) != wiring.state_summary(opts[1])
        assert one_round() == [True, True]
        with torch.no_grad():
            nets[1].weight.copy_(nets[0].weight)
        opts[1].tracker.global_progress.num_peers = 3
        assert one_round() == [True, True]
        assert len(skipped[0]) == len(skipped[1]) == 1, skipped
    finally:
        for averager in (*grads, *states):
            averager.shutdown()


def test_only_one_well_formed_state_across_a_whole_group_counts_as_agreement():
    """in_agreement (item 16) reads what groupmates sent: norms equal to rounding (1e-6), the same exact
    digest, a group of all the peers any member counts; anything malformed is disagreement."""
    state = {"norms": [3.0, 1.5, 2.0, 0.0], "exact": b"d" * 16}
    one = {"state": state, "peers": 2}

    def other(**changes: object) -> dict:
        return {**one, "state": {**state, **changes}}

    assert wiring.in_agreement({"a": one, "b": dict(one)})
    assert wiring.in_agreement({"a": one, "b": other(norms=[3.0 * (1 + 5e-7), 1.5, 2.0, 0.0])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0 * (1 + 2e-6), 1.5, 2.0, 0.0])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0, 1.5, 2.0, 1e-30])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0, 1.5, 2.0])})
    assert not wiring.in_agreement({"a": one, "b": other(exact=b"e" * 16)})  # e.g. another epoch
    assert not wiring.in_agreement({"a": one})  # alone
    assert not wiring.in_agreement({"a": one, "b": {**one, "peers": 3}})  # B counts one more peer
    assert not wiring.in_agreement({"a": one, "b": {**one, "state": None}})  # not a state epoch for B
    malformed = (
        None,
        "state",
        7,
        [one],
        {**one, "peers": True},
        {**one, "peers": "2"},
        other(norms=[3.0, 1.5, 2.0, float("nan")]),
        other(norms=[3, 1.5, 2.0, 0.0]),
        other(norms="3.0"),
        other(exact="d" * 16),
    )
    for junk in malformed:
        assert not wiring.in_agreement({"a": one, "b": junk}), junk
    assert not wiring.in_agreement(allreduce.Gathered.without({"a": one, "b": one, "c": one}, {"c"}))


@PLAIN_OR_PATCHED
def test_peers_whose_adamw_counted_different_steps_take_the_same_update_at_one_epoch(patched):
    """Item 17: two peers with the same parameters, AdamW moments and gradient but step counters 58 and 61
    (as three demo peers' were at global epoch 60: 58, 60, 61). Plain hivemind shares the counters with a
    newcomer but never averages them (optim/state_averager.py:98-124: only ``average_opt_statistics``), and
    AdamW's bias correction (1 - 0.999^t) then makes A's update 0.977 of B's, counters 59 and 62. With
    number_steps_by_epoch both count the epoch the update comes from (61) and update alike."""

    def peer(counter: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(net.parameters(), lr=0.003, weight_decay=0.05)
        _gradients(net, 1.0, seed=0)
        opt.step()  # moments exist
        for state in opt.state.values():
            state["step"].fill_(counter)
        _gradients(net, 1.0, seed=1)
        if patched:  # the state averager has numbered the new epoch 61 when the update runs
            wiring.number_steps_by_epoch(SimpleNamespace(local_epoch=61), opt)
        before = [p.detach().clone() for p in net.parameters()]
        opt.step()
        return [p.detach() - b for p, b in zip(net.parameters(), before, strict=True)], opt

    (update_a, opt_a), (update_b, opt_b) = peer(58), peer(61)
    same = all(torch.equal(u, v) for u, v in zip(update_a, update_b, strict=True))
    assert same == patched
    steps = [sorted({float(state["step"]) for state in o.state.values()}) for o in (opt_a, opt_b)]
    if patched:
        assert steps == [[61.0], [61.0]], steps
    else:
        assert steps == [[59.0], [62.0]], steps
        ratio = total_norm(update_a) / total_norm(update_b)
        assert ratio == pytest.approx(0.977, abs=0.001), ratio


def _newcomer(node: hivemind.DHT, run: str, net: torch.nn.Module) -> hivemind.Optimizer:
    """A plain hivemind.Optimizer of ``net`` (SGD, lr 0.1) that downloads the state of ``run``'s donors."""
    return hivemind.Optimizer(
        dht=node,
        run_id=run,
        params=net.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=2.0,
        averaging_timeout=4.0,
        averager_opts={"request_timeout": 1.5},
        load_state_timeout=20.0,
    )


def test_a_download_one_epoch_behind_the_swarm_keeps_the_epoch_number_of_its_state(dhts, caplog):
    """Item 13. The only donor serves epoch 5 while another peer already announces epoch 6. Plain
    hivemind.Optimizer numbers the newcomer's download 6 ("Catching up with collaboration step",
    optim/optimizer.py:705-707): epoch 5's parameters under 6's number. With download_the_epoch_it_names it
    downloads again, and keeps epoch 5 with the donor's parameters exactly. The same newcomer downloads
    both ways, its parameters and epoch reset before each."""
    node_d, node_n = dhts(2)
    run = "pytest-rounds-behind"
    torch.manual_seed(0)
    donor_net, new_net = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    (donor,) = _state_averagers([node_d], [donor_net], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 5
    # a peer one epoch ahead that only reports progress (its own key: records are signed per key)
    ahead = ProgressTracker(node_d, run, target_batch_size=8, private_key=RSAPrivateKey(), start=True)
    opt = None
    try:
        ahead.report_local_progress(6, 1)
        assert wait_until(lambda: node_d.get(ahead.training_progress_key, latest=True), timeout=20)
        opt = _newcomer(node_n, run, new_net)
        hivemind_download = partial(hivemind.Optimizer.load_state_from_peers, opt)
        wiring.download_the_epoch_it_names(opt, attempts=2, pause=0.2)
        assert wait_until(lambda: opt.tracker.global_epoch == 6, timeout=20), opt.tracker.global_progress

        def download(load: Any) -> int:
            """The newcomer at epoch 0 with parameters of its own downloads; returns its epoch after."""
            with torch.no_grad(), opt.tracker.pause_updates():
                for p in new_net.parameters():
                    p.fill_(0.5)
                opt.state_averager.local_epoch = 0
                opt.tracker.report_local_progress(0, 0)
            load()
            assert opt.local_epoch == opt.tracker.local_progress.epoch
            for p, q in zip(new_net.parameters(), donor_net.parameters(), strict=True):
                torch.testing.assert_close(p.detach(), q.detach())  # the donor's state, epoch 5's
            return opt.local_epoch

        assert download(hivemind_download) == 6  # epoch 5's parameters under 6's number
        with caplog.at_level("INFO", logger="swarm.patches.optimizer"):
            assert download(opt.load_state_from_peers) == 5
        messages = [r.getMessage() for r in caplog.records if r.name == "swarm.patches.optimizer"]
        assert messages == [
            "Downloaded the state of global epoch 5 while the swarm is at 6; downloading again",
            "Kept global epoch 5, the epoch of the state downloaded (the swarm is at 6); the next step "
            "downloads again",
        ], messages
    finally:
        ahead.shutdown()
        if opt is not None:
            opt.shutdown()
        donor.shutdown()


def test_an_epoch_reached_by_a_download_is_recorded_as_downloaded_not_as_a_round_alone(dhts):
    """swarm/averaging/rounds.py: a peer behind the swarm reaches its new epoch by a download (hivemind's
    ``step`` calls ``load_state_from_peers`` instead of ending a round). Its record says ``downloaded``
    (group 0); before, it said ``alone``, and a newcomer's first download counted as a round it trained
    alone. An epoch that the optimizer's own update ended, with no other peer, is still ``alone``."""
    node_d, node_n = dhts(2)
    run = "pytest-rounds-downloaded"
    torch.manual_seed(0)
    donor_net, new_net = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    (donor,) = _state_averagers([node_d], [donor_net], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 5
    opt = _newcomer(node_n, run, new_net)
    clock = RoundClock(opt, opt.state_averager.optimizer)
    try:
        opt.load_state_from_peers()  # what hivemind's step does for a peer behind the swarm
        assert opt.local_epoch == 5
        downloaded = clock.close_round(opt.local_epoch, 0.2)
        assert (downloaded["outcome"], downloaded["group"]) == ("downloaded", 0), downloaded
        for p in new_net.parameters():
            p.grad = torch.ones_like(p)
        opt._update_global_epoch(None)  # as hivemind's step ends an epoch; nobody else looks for a group
        assert opt.local_epoch == 6
        alone = clock.close_round(opt.local_epoch, 0.2)
        assert (alone["outcome"], alone["group"]) == ("alone", 1), alone
        summary = clock.summary()
        assert (summary["downloaded"], summary["alone"], summary["averaged"]) == (1, 1, 0), summary
    finally:
        clock.close()
        opt.shutdown()
        donor.shutdown()


def _step_while_at(opt: hivemind.Optimizer, epoch: int, seconds: float, most: int | None = None) -> int:
    """Steps of ``opt`` on gradients of ones, 50 ms apart, until it leaves ``epoch``, ``seconds`` pass or it
    took ``most`` steps; returns how many."""
    deadline, steps = time.monotonic() + seconds, 0
    while time.monotonic() < deadline and opt.local_epoch == epoch and (most is None or steps < most):
        for p in opt.state_averager.main_parameters:
            p.grad = torch.ones_like(p)
        opt.step()
        steps += 1
        time.sleep(0.05)
    return steps


def _checked_downloads_behind(
    opt: hivemind.Optimizer, node: Any, run: str, donor: Any, patched: bool
) -> list:
    """``opt`` (on ``node``) with item 23's download check and, if ``patched``,
    decide_downloads_after_refusals; returns the list that counts its downloads, once its tracker reads the
    claim of epoch 50 and ``donor``'s record in the DHT (A's first download must find the donor: a download
    that reads no donor asks nobody)."""
    from swarm.averaging import donors
    from tests.patches.test_state_averager import _donor_visible

    opt.state_averager.check_download = donors.DonorCheck(node, run, node.peer_id.to_base58())
    if patched:
        wiring.decide_downloads_after_refusals(opt)
    download, downloads = opt.load_state_from_peers, []
    opt.load_state_from_peers = lambda **kwargs: downloads.append(1) or download(**kwargs)
    assert wait_until(lambda: opt.tracker.global_epoch == 50, timeout=20), opt.tracker.global_progress
    assert wait_until(lambda: _donor_visible(node, f"{run}_state_averager", donor), timeout=20)
    return downloads


@PLAIN_OR_PATCHED
def test_a_peer_that_refused_the_only_donor_ahead_trains_on_instead_of_downloading_at_every_step(
    dhts, patched, monkeypatch
):
    """Item 24. Donor D declares and reports epoch 50 while the only other peer whose records A reads is at
    epoch 0: A's download check (item 23) refuses D's state as ahead of every other peer's. Without item 24,
    A's tracker still puts the swarm at D's epoch, so every step of A finds it behind and calls for a
    download (with D refused, there is no donor left) and returns before accumulating anything: A never
    leaves epoch 0. With decide_downloads_after_refusals, A downloads once, reads the swarm again, counts D at
    its own epoch, and trains on: its round with nobody fails and it steps on its own gradient to epoch 1."""
    from swarm.averaging import donors
    from tests.patches.test_state_averager import _publish_sketch

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 0.5)
    node_d, node_a = dhts(2)
    run = f"pytest-rounds-refused-ahead-{patched}"
    torch.manual_seed(0)
    donor_net = torch.nn.Linear(4, 3)
    (donor,) = _state_averagers([node_d], [donor_net], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 50
    ahead = ProgressTracker(node_d, run, target_batch_size=8, private_key=RSAPrivateKey(), start=True)
    try:
        ahead.report_local_progress(50, 1)
        _publish_sketch(node_a, run, "other", "other-peer", 0, [torch.ones(3)])
        with _lone_optimizer(node_a, run) as opt:
            refusals: list = []
            downloads = _checked_downloads_behind(opt, node_a, run, donor, patched)
            opt.state_averager.on_refused = lambda donor, reason: refusals.append(reason)

            # plain hivemind: 40 steps that stay at epoch 0 (135-156 in 10 s alone, 18 on a starved machine)
            steps = _step_while_at(opt, 0, 30.0, most=None if patched else 40)
            assert refusals and "ahead of every other peer's" in refusals[0], (refusals, downloads, steps)
            if patched:
                assert opt.local_epoch == 1, (opt.local_epoch, opt.tracker.global_progress)
                assert len(downloads) == 1, (len(downloads), steps)
            else:
                assert opt.local_epoch == 0 and opt.tracker.global_epoch == 50
                assert len(downloads) >= steps // 2 and steps >= 20, (len(downloads), steps)
    finally:
        ahead.shutdown()
        donor.shutdown()


@PLAIN_OR_PATCHED
@pytest.mark.parametrize("own", [0, 5], ids=["donor at A's epoch", "donor behind A"])
@pytest.mark.parametrize("who", ["no donor", "a donor not asked", "the donor asked"])
def test_a_peer_behind_an_epoch_that_no_donor_serves_trains_on_instead_of_downloading_at_every_step(
    dhts, patched, own, who, caplog, monkeypatch
):
    """Item 25. A peer C reports epoch 10^6 in its progress record; donor D serves the state of epoch 0, A's
    own or older than A's (then hivemind drops it and A keeps its own). hivemind puts the swarm at C's epoch,
    and at every step A finds itself behind, downloads D's state, is still behind, and returns before
    accumulating anything: A never leaves its epoch. With decide_downloads_after_refusals, A downloads once,
    counts C at its own epoch, and trains on: its round with nobody fails and it steps on its own gradient to
    the next epoch. A C that is no donor is named in a warning, and so is D itself where it is the claimer and
    A asked it (A chooses its donors with item 23's check); a C that declares itself a donor (at an epoch
    below D's, so that A asks D) is not: it may be an honest donor whose declaration lags its progress (item
    18) or that stepped on during the download, and A did not ask it (seen in the monitor's test: a newcomer
    that asked another newcomer still behind warned of the first peer)."""
    from swarm.averaging import donors as donor_checks
    from tests.patches.test_state_averager import _donor_visible

    node_c, node_d, node_a = dhts(3)
    run = f"pytest-rounds-unserved-claim-{patched}-{own}-{who.replace(' ', '-')}"
    torch.manual_seed(0)
    (donor,) = _state_averagers([node_d], [torch.nn.Linear(4, 3)], f"{run}_state_averager")
    claimer = ProgressTracker(
        node_d if who == "the donor asked" else node_c,
        run,
        target_batch_size=8,
        private_key=RSAPrivateKey(),
        start=True,
    )
    claiming_donor = None
    if who == "a donor not asked":
        (claiming_donor,) = _state_averagers([node_c], [torch.nn.Linear(4, 3)], f"{run}_state_averager")
        claiming_donor.state_sharing_priority = -1  # declared below D: A asks D
    try:
        claimer.report_local_progress(10**6, 1)
        # plain hivemind downloads at every step, up to 40 times in a row: with the 0.5 s wait per chunk one
        # of them could time out on a loaded machine, though D served it (kept had a False)
        with _lone_optimizer(node_a, run, chunk_timeout=10.0) as opt:
            if who == "the donor asked":  # A asks one donor at a time, and so knows which one answered
                monkeypatch.setattr(donor_checks, "WAIT_FOR_SKETCHES", 0.5)
                check = donor_checks.DonorCheck(node_a, run, node_a.peer_id.to_base58())
                opt.state_averager.check_download = check
            if patched:
                wiring.decide_downloads_after_refusals(opt)
                # the tracker reads while a download marks the claimers (as it may on a loaded machine): a
                # read that lands before the marks are in place must not send this peer to download again
                declared = opt.state_averager.declared_donors

                def declared_while_the_tracker_reads() -> set[str]:
                    seen = opt.tracker.global_progress
                    progress.read_within(opt.tracker, 0.0)
                    assert wait_until(lambda: opt.tracker.global_progress is not seen, timeout=10)
                    return declared()

                opt.state_averager.declared_donors = declared_while_the_tracker_reads
            download, downloads, kept = opt.load_state_from_peers, [], []

            def counted_download(**kwargs):
                downloads.append(1)
                result = download(**kwargs)
                kept.append(opt.state_averager.donor_answered)
                return result

            opt.load_state_from_peers = counted_download
            opt.state_averager.local_epoch = own
            with opt.tracker.pause_updates():
                opt.tracker.update_epoch(own)
            claimed = wait_until(lambda: opt.tracker.global_epoch == 10**6, timeout=20)
            assert claimed, opt.tracker.global_progress
            donors = [donor] if claiming_donor is None else [donor, claiming_donor]
            visible = lambda: all(_donor_visible(node_a, f"{run}_state_averager", d) for d in donors)  # noqa: E731
            assert wait_until(visible, timeout=20)

            with caplog.at_level(logging.INFO, logger="swarm.patches.optimizer"):
                steps = _step_while_at(opt, own, 30.0, most=None if patched else 40)  # as above
            assert kept and all(kept), kept  # every download got D's answer: D served, C did not
            if patched:
                assert opt.local_epoch == own + 1, (opt.local_epoch, opt.tracker.global_progress)
                assert len(downloads) == 1, (len(downloads), steps)
                ours = [r for r in caplog.records if r.name == "swarm.patches.optimizer"]
                warned = [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
                told = [r.getMessage() for r in ours if "did not ask" in r.getMessage()]
                if who == "a donor not asked":
                    assert not warned and len(told) == 1 and "epochs up to 1000000" in told[0], caplog.text
                else:
                    why = (
                        "it serves no state"
                        if who == "no donor"
                        else "this peer asked it, and it served an older"
                    )
                    assert len(warned) == 1 and why in warned[0] and not told, caplog.text
            else:
                assert opt.local_epoch == own and opt.tracker.global_epoch == 10**6
                assert len(downloads) >= steps // 2 and steps >= 20, (len(downloads), steps)
    finally:
        claimer.shutdown()
        donor.shutdown()
        if claiming_donor is not None:
            claiming_donor.shutdown()


@PLAIN_OR_PATCHED
def test_a_peer_behind_a_donor_that_left_trains_on_instead_of_dialling_it_at_every_step(
    dhts, patched, monkeypatch, caplog
):
    """Item 32. Donor D declares and reports epoch 50, then leaves without a word (its p2p daemon ends at
    once, as under a SIGTERM to its process group): its records stay in the DHT until they expire. A, at
    epoch 0, reads D's claim and finds itself behind; its download dials D, which fails. Without
    decide_downloads_after_refusals every step of A downloads again, dials D again, and returns before
    accumulating anything: A never leaves epoch 0. With it, A downloads once, counts D at its own epoch, and
    trains on: its round with nobody fails and it steps on its own gradient to epoch 1."""
    from swarm.averaging import donors
    from tests.patches.test_state_averager import _donor_visible

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 0.5)
    node_d, node_a = dhts(2)
    run = f"pytest-rounds-donor-left-{patched}"
    (donor,) = _state_averagers([node_d], [torch.nn.Linear(4, 3)], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 50
    claimer = ProgressTracker(node_d, run, target_batch_size=8, private_key=RSAPrivateKey(), start=True)
    try:
        claimer.report_local_progress(50, 1)
        with _lone_optimizer(node_a, run) as opt:
            downloads = _checked_downloads_behind(opt, node_a, run, donor, patched)
            # D ends as a process does: its tracker stops without storing the empty record that hivemind's
            # shutdown leaves in its place, and its p2p daemon ends; its records stay in A's storage
            claimer.shutdown_triggered.set()
            claimer.should_report_progress.set()
            claimer.global_state_updated.set()
            assert claimer.shutdown_complete.wait(10)
            donor.shutdown()
            node_d.shutdown()
            assert _donor_visible(node_a, f"{run}_state_averager", donor)
            progress.read_within(opt.tracker, 0.0)
            assert wait_until(lambda: opt.tracker.global_epoch == 50, timeout=20), opt.tracker.global_progress

            with caplog.at_level(logging.INFO, logger="swarm.patches.optimizer"):
                steps = _step_while_at(opt, 0, 30.0, most=None if patched else 40)
            if patched:
                assert opt.local_epoch == 1, (opt.local_epoch, opt.tracker.global_progress)
                assert len(downloads) == 1, (len(downloads), steps)
                assert "could not be dialled for a download" in caplog.text, caplog.text
            else:
                assert opt.local_epoch == 0 and opt.tracker.global_epoch == 50
                assert len(downloads) >= steps // 2 and steps >= 20, (len(downloads), steps)
            assert opt.state_averager.unreachable.keys() == {node_d.peer_id.to_base58()}  # asked, not reached
    finally:
        if not claimer.shutdown_triggered.is_set():
            claimer.shutdown()
        donor.shutdown()


def test_a_peer_behind_a_donor_that_bans_it_trains_on_instead_of_asking_it_at_every_step(
    dhts, monkeypatch, caplog
):
    """Item 32. Donor D declares and reports epoch 50, ahead of A at epoch 0, and bans A (its gradients
    pointed against D's own: an attacker bans the honest peers it judges, and its groups without them run
    ahead), so D's averagers refuse A's download (swarm/patches/rpc_guard.py). A downloads once, is refused,
    counts D at its own epoch and trains on: its round with nobody fails and it steps on its own gradient to
    epoch 1. Without that, A asks D again at every step and never leaves epoch 0 (the attack bench's honest
    peers asked two such attackers 130-167 times each in 30 s)."""
    from swarm import suspects
    from swarm.averaging import donors
    from swarm.patches import robust

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 0.5)
    node_d, node_a = dhts(2)
    run = "pytest-rounds-donor-bans"
    (donor,) = _state_averagers([node_d], [torch.nn.Linear(4, 3)], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 50
    claimer = ProgressTracker(node_d, run, target_batch_size=8, private_key=RSAPrivateKey(), start=True)
    table = robust.suspects()
    try:
        claimer.report_local_progress(50, 1)
        # one table for both peers here (one process): D's gate reads it when A calls
        for _ in range(suspects.DIR_SHORT_WINDOW):
            table.noted_direction(node_a.peer_id.to_base58(), -0.5)
        assert table.banned_for(node_a.peer_id.to_base58()) > 0
        with _lone_optimizer(node_a, run) as opt:
            downloads = _checked_downloads_behind(opt, node_a, run, donor, True)
            with caplog.at_level(logging.INFO, logger="swarm.patches"):
                steps = _step_while_at(opt, 0, 30.0)
            assert opt.local_epoch == 1, (opt.local_epoch, opt.tracker.global_progress, steps)
            assert len(downloads) == 1, (len(downloads), steps)
            assert "or refused it (they ban this peer)" in caplog.text, caplog.text
            assert opt.state_averager.unreachable.keys() == {node_d.peer_id.to_base58()}
            assert not opt.state_averager.refused_donors  # nothing it served was refused: it served nothing
    finally:
        table.clear()
        claimer.shutdown()
        donor.shutdown()
