"""What swarm/patches/optimizer.py changes on one hivemind.Optimizer: judged gradients (item 7), rounds never
skipped (item 10), downloads numbered with their epoch (item 13), agreed state rounds skipped (item 16),
AdamW's counters by epoch (item 17)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager

from swarm.averaging.diloco import DiLoCo
from swarm.averaging.screen import total_norm
from swarm.patches import allreduce, grad_averager, matchmaking
from swarm.patches import optimizer as wiring
from swarm.procs import stop_group
from swarm.waiting import wait_until
from tests.patches.common import (
    MATCHMAKING,
    _assert_a_holds,
    _gradients,
    _optimizer_beside_a_progress_only_peer,
    _progress_only_peer,
    _screened_gradient_pair,
    _screened_round,
    _state_averagers,
)


def test_an_outsized_averaged_gradient_is_rejected_for_the_peers_own(dhts):
    """In the first round B is honest and A applies the exact mean; in the second B's gradient is 10,000
    times too large, and A's screen puts A's own gradient where the mean was, counts the round and says why.
    (A plain hivemind GradientAverager cannot average with the swarm's packed parts at all: its round fails
    with "received 0.0% results".)"""
    with _screened_gradient_pair(dhts, "pytest-rounds-screen") as pair:
        *_, screen, rejected, loaded = pair
        own, theirs = _screened_round(pair, (1.0, 4), (1.0, 4), seed=0, b_seed=10)
        _assert_a_holds(pair, [(g + h) / 2 for g, h in zip(own, theirs, strict=True)])
        own, _ = _screened_round(pair, (1.0, 4), (1e4, 4), seed=1, b_seed=11)
        _assert_a_holds(pair, own)
        assert len(loaded) == 2  # hivemind's own loading ran after the screen, both times
        assert screen.rejected_gradient_rounds == 1 and len(screen.norms) == 1, screen.__dict__
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 4, rejected
        assert "x this peer's reference" in reason and "the limit is 10x" in reason, reason


def test_a_diloco_peer_after_one_inner_step_accepts_the_mean_of_peers_that_took_sixteen(dhts):
    """A DiLoCo newcomer joins its first outer round after 1 inner step while B took 16 (H = 16): B's
    pseudo-gradient is 16 times A's, and the mean weighted by samples (1 and 16 batches) is 257/17 = 15.1
    times A's own, past the screen's 10x. Scaled by H / steps taken (DiLoCo.pseudo_gradient_scale), A
    accepts that honest mean; B 10,000 times too large is still rejected. Without the scale A rejected the
    first round (seen in the DiLoCo test's summaries, 2026-11-25: ``rejected: ['gradient']``)."""
    inner = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    diloco = DiLoCo(inner, local_steps=16, outer_lr=0.7, outer_momentum=0.9)
    diloco.steps = 1
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


def test_a_state_round_is_skipped_only_when_the_whole_group_sent_one_state(dhts):
    """Item 16 on real averagers: A and B each hold the swarm's gradient averager and state averager over a
    net; their gradient rounds carry each one's state digest and tracker count in hivemind's all-gather.
    Equal nets: both skip the epoch's state round (they would average equal tensors). B's weight moved by
    1e-3: both hold it. Equal again, but B's tracker counts a third peer that is not in the group: both hold
    it. The state steps are recorded with what hivemind.Optimizer would pass, not run."""
    nodes = dhts(2)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    states = _state_averagers(nodes, nets, "pytest-rounds-agree-state")
    common = dict(
        prefix="pytest-rounds-agree", min_matchmaking_time=MATCHMAKING, request_timeout=1.5, start=True
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


def test_peers_whose_adamw_counted_different_steps_take_the_same_update_at_one_epoch():
    """Item 17: two peers with the same parameters, AdamW moments and gradient but step counters 58 and 61
    (as three demo peers' were at global epoch 60: 58, 60, 61) update differently through AdamW's bias
    correction; with number_steps_by_epoch both count the epoch the update comes from, and update alike."""

    def peer(counter: int, numbered: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(net.parameters(), lr=0.003, weight_decay=0.05)
        _gradients(net, 1.0, seed=0)
        opt.step()  # moments exist
        for state in opt.state.values():
            state["step"].fill_(counter)
        _gradients(net, 1.0, seed=1)
        if numbered:  # the state averager has numbered the new epoch 61 when the update runs
            wiring.number_steps_by_epoch(SimpleNamespace(local_epoch=61), opt)
        opt.step()
        return net, opt

    for numbered in (False, True):
        (a, opt_a), (b, opt_b) = peer(58, numbered), peer(61, numbered)
        same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        assert same == numbered, numbered
    steps = {float(state["step"]) for o in (opt_a, opt_b) for state in o.state.values()}
    assert steps == {61.0}, steps


def test_a_round_starts_when_the_last_ones_control_is_still_there(dhts):
    """When no round was pre-scheduled for this epoch, hivemind.Optimizer still holds the previous round's
    control, drops it as "already used elsewhere", and starts no round at all (its groupmates then waited
    for it until averaging_timeout). With never_cancel_rounds a fresh round starts."""
    (node_a,) = dhts(1)
    with _optimizer_beside_a_progress_only_peer(node_a, torch.nn.Linear(4, 3)) as opt_a:

        def begin_with_a_used_control(opt: hivemind.Optimizer) -> bool:
            used = opt.grad_averager.schedule_step(timeout=4.0)
            used.cancel()  # as done as the last round's control
            opt.scheduled_grads = used
            began = opt._begin_averaging_gradients(None)
            fresh = opt.scheduled_grads
            if fresh is not None and fresh is not used and not fresh.done():
                fresh.cancel()
            # cancelled here, so not again by opt.shutdown(): a second cancel of a control whose stage the
            # averager process has not yet moved on raises InvalidStateError (a fresh-clone suite)
            opt.scheduled_grads = None
            return began and fresh is not None and fresh is not used

        assert not begin_with_a_used_control(opt_a)  # hivemind's own: no round
        wiring.never_cancel_rounds(opt_a)
        assert begin_with_a_used_control(opt_a)


def test_a_download_one_epoch_behind_the_swarm_keeps_the_epoch_number_of_its_state(dhts, caplog):
    """The only donor serves epoch 5 while another peer already announces epoch 6. hivemind.Optimizer would
    number the newcomer's download 6 ("Catching up with collaboration step"): epoch 5's parameters under 6's
    number. With item 13 it downloads again, and keeps epoch 5 with the donor's parameters exactly."""
    node_d, node_n = dhts(2)
    run = "pytest-rounds-behind"
    torch.manual_seed(0)
    donor_net, new_net = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    (donor,) = _state_averagers([node_d], [donor_net], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 5
    ahead = _progress_only_peer(node_d, run, 6)
    opt = hivemind.Optimizer(
        dht=node_n,
        run_id=run,
        params=new_net.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=2.0,
        averaging_timeout=4.0,
        averager_opts={"request_timeout": 1.5},
        load_state_timeout=20.0,
    )
    try:
        wiring.download_the_epoch_it_names(opt, attempts=2, pause=0.2)
        assert wait_until(lambda: opt.tracker.global_epoch == 6, timeout=60), opt.tracker.global_progress
        with caplog.at_level("INFO", logger="swarm.patches.optimizer"):
            opt.load_state_from_peers()
        assert opt.local_epoch == 5 and opt.tracker.local_progress.epoch == 5
        for p, q in zip(new_net.parameters(), donor_net.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())
        messages = [r.getMessage() for r in caplog.records if r.name == "swarm.patches.optimizer"]
        assert messages == [
            "Downloaded the state of global epoch 5 while the swarm is at 6; downloading again",
            "Kept global epoch 5, the epoch of the state downloaded (the swarm is at 6); the next step "
            "downloads again",
        ], messages
        # what this guards against: hivemind's own download, in the same swarm, numbers the same state 6
        hivemind.Optimizer.load_state_from_peers(opt)
        assert opt.local_epoch == 6
    finally:
        stop_group(ahead, grace=10.0)
        opt.shutdown()
        donor.shutdown()
