"""The round screen (swarm/averaging/screen.py) on its own: what it accepts and rejects, by the figures."""

from __future__ import annotations

import pytest
import torch

from swarm import suspects
from swarm.averaging.screen import RoundScreen, total_norm

ROLES = ["parameters", "extra tensors"]


def _state(params: float, moments: float) -> list[torch.Tensor]:
    """Parameters and moments of these norms, 100 numbers each."""
    return [torch.full((100,), params / 10), torch.full((100,), moments / 10)]


def test_moments_get_the_squared_limit_and_young_ones_are_judged_against_the_recent_accepted_states():
    screen = RoundScreen(10.0)
    # honest DiLoCo peers' inner moments differed by more than 10x: 11x passes for moments...
    assert screen.judge_state(_state(50, 0.98), _state(50, 10.8), ROLES) is None
    # ... but not for parameters
    reason = screen.judge_state(_state(50, 0.98), _state(550, 0.98), ROLES)
    assert reason == (
        "the averaged parameters have norm 550, 11x this peer's reference 50 (its own 50; the limit is 10x)"
    ), reason
    # a peer whose moments start over (a newcomer's first inner steps) is judged against the median of the
    # states it accepted, not its own alone: 183x its own, 0.85x that median
    for _ in range(2):
        assert screen.judge_state(_state(50, 9.0), _state(50, 10.8), ROLES) is None
    assert total_norm(_state(50, 9.14)[1:]) / total_norm(_state(50, 0.05)[1:]) > 100
    assert screen.judge_state(_state(50, 0.05), _state(50, 9.14), ROLES) is None
    # an attacker's moments (exp_avg_sq after 10,000x gradients) are rejected all the same, with the figures
    reason = screen.judge_state(_state(50, 0.05), _state(50, 9.5e8), ROLES, kind="download")
    assert reason is not None and "the downloaded extra tensors have norm 9.5e+08" in reason, reason
    assert "reference 10.8 (its own 0.05; the limit is 100x)" in reason, reason
    assert (screen.rejected_state_rounds, screen.rejected_downloads) == (1, 1)


def test_an_all_zero_part_is_judged_by_finiteness_alone_and_a_rejected_state_teaches_nothing():
    screen = RoundScreen(10.0)
    # a newcomer's optimizer statistics are all zeros: any finite size passes, a non-finite one does not
    assert screen.judge_state(_state(50, 0.0), _state(50, 9.14), ROLES, kind="download") is None
    bad = _state(50, 9.14)
    bad[1][0] = float("nan")
    assert screen.judge_state(_state(50, 0.0), bad, ROLES, kind="download") == (
        "the downloaded extra tensors are non-finite"
    )
    assert screen.in_row["download"] == 1
    # the accepted state is remembered, the rejected one not
    assert list(screen.part_norms["extra tensors"]) == [total_norm(_state(50, 9.14)[1:])]
    # factor 0: only non-finite numbers are rejected
    assert RoundScreen(0.0).judge_state(_state(50, 1.0), _state(5e9, 1e9), ROLES) is None


def test_an_averaged_state_far_from_this_peers_parameters_is_rejected_but_not_a_download():
    """Two colluders in a state round of three make its robust result theirs: random parameters of an honest
    norm lie about 1.41 times that norm from this peer's. Peers at one global epoch hold nearly one state
    (a peer that stepped alone for a few epochs: a few hundredths of the norm away), so the screen rejects
    averaged parameters more than STATE_RADIUS (0.25) away, where two colluders in a group of four left the
    result 0.46-0.49 away in the attack bench; moments are not judged so, nor is a DiLoCo state (with extra
    tensors: its peers' parameters honestly differ between outer rounds), nor a download (a newcomer's own
    parameters are not the swarm's)."""
    from swarm.averaging.screen import STATE_RADIUS

    one_state = ["parameters", "optimizer statistics"]

    gen = torch.Generator().manual_seed(2)
    mine = [torch.randn(10_000, generator=gen), torch.rand(10_000, generator=gen)]
    noise = torch.randn(10_000, generator=gen)
    colluders = [noise * mine[0].norm() / noise.norm(), mine[1]]
    stepped = [mine[0] + 0.03 * torch.randn(10_000, generator=gen), 5 * torch.rand(10_000, generator=gen)]
    screen = RoundScreen(10.0)
    assert screen.take_state_away() is None
    assert screen.judge_state(mine, stepped, one_state) is None
    # the accepted round's distance is kept for the round's record, once
    moved = (stepped[0] - mine[0]).norm() / mine[0].norm()
    assert screen.take_state_away() == pytest.approx(float(moved), rel=1e-5)
    assert screen.take_state_away() is None
    reason = screen.judge_state(mine, colluders, one_state)
    assert reason is not None and "the averaged parameters lie 1.4" in reason, reason
    assert f"the limit is {STATE_RADIUS:g}" in reason and screen.rejected_state_rounds == 1
    assert screen.judge_state(mine, colluders, one_state, kind="download") is None
    assert RoundScreen(0.0).judge_state(mine, colluders, one_state) is None  # the screen off
    away = colluders[0] - mine[0]
    half = [mine[0] + away * (0.46 * mine[0].norm() / away.norm()), mine[1]]  # two colluders of four
    reason = screen.judge_state(mine, half, one_state)
    assert reason is not None and "the averaged parameters lie 0.46" in reason, reason
    assert screen.judge_state(mine, colluders, ROLES) is None  # the second tensor an extra one: DiLoCo's
    assert screen.take_state_away() is None  # rejected rounds and DiLoCo's states leave no distance


def _pair_round(noise: float, flip: float, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(this peer's gradient, the mean of a round of two with equal samples) where the other peer sends its
    own honest gradient times ``flip``; both estimate one true gradient of norm 1, off by ``noise`` times."""
    gen = torch.Generator().manual_seed(seed)
    true = torch.randn(100_000, generator=gen) / 100_000**0.5
    mine, theirs = (true + noise * torch.randn(100_000, generator=gen) / 100_000**0.5 for _ in range(2))
    return [mine], [(mine + flip * theirs) / 2]


def test_a_round_of_two_is_judged_by_its_distance_from_the_peers_own_gradient():
    """Where no rule can outvote the other of two, the screen bounds what it can do: honest rounds pass at any
    noise and with unequal weights, a flip at x8 is rejected, a flip at x1, x2 or x4 passes (left to the
    groups of three, where the robust mean clips it and its peers ban it). Only a round of two scores the
    other peer by its distance."""
    for noise in (0.1, 1.0, 4.0):  # the gradients' cosine: 0.99, 0.5, 0.06
        for seed in range(5):
            own, averaged = _pair_round(noise, 1.0, seed)
            screen = RoundScreen(10.0)
            assert screen.judge_gradients(averaged, own, group_size=2) is None
            assert screen.pair_scale >= suspects.SUSPECT_SCALE, (noise, seed, screen.last_pair_distance)
    for noise in (0.1, 1.0, 4.0):
        own, averaged = _pair_round(noise, -8.0, seed=7)
        reason = RoundScreen(10.0).judge_gradients(averaged, own, group_size=2)
        assert reason is not None and "in a round of two" in reason, noise
        screen = RoundScreen(10.0)  # the same average from a larger group: rejected, and nobody scored
        reason = screen.judge_gradients(averaged, own, group_size=3)
        assert reason is not None and reason.startswith("in a round of 3, the averaged gradient lies")
        assert screen.last_pair_distance == 0.0 and screen.pair_scale == 1.0
    own, averaged = _pair_round(1.0, -8.0, seed=7)
    reason = RoundScreen(10.0).judge_gradients(averaged, own, group_size=2)
    assert (
        reason.startswith("in a round of two, the averaged gradient lies 4.3x this peer") and "3x" in reason
    )
    for flip in (-1.0, -2.0, -4.0):  # passes; x4 still counts against the other (swarm/suspects.py)
        own, averaged = _pair_round(1.0, flip, seed=7)
        screen = RoundScreen(10.0)
        assert screen.judge_gradients(averaged, own, group_size=2) is None
        clipped = screen.pair_scale < suspects.SUSPECT_SCALE
        assert clipped == (flip == -4.0), (flip, screen.last_pair_distance)
    # unequal weights: a peer of 32 samples (a noisy gradient) in a round with one of 224 whose gradient's
    # cosine with its own is -0.5 (seen in the demo): the average is the other's, and passes
    gen = torch.Generator().manual_seed(11)
    mine = torch.randn(100_000, generator=gen)
    noise = torch.randn(100_000, generator=gen)
    noise -= (noise @ mine) / (mine @ mine) * mine  # orthogonal to mine
    theirs = 0.38 * (-0.5 * mine / mine.norm() + 0.75**0.5 * noise / noise.norm()) * mine.norm()
    assert float(mine @ theirs / (mine.norm() * theirs.norm())) == pytest.approx(-0.5, abs=1e-4)
    averaged = [(32 * mine + 224 * theirs) / 256]
    assert RoundScreen(10.0).judge_gradients(averaged, [mine], group_size=2) is None


def test_suspects_are_banned_when_far_round_after_round_for_longer_each_time():
    table = suspects.Suspects()
    honest, attacker = "12D3KooWhonest", "12D3KooWattacker"
    # An honest peer far from the others now and then, as the multi-peer localhost test's peers were (0.2-2 %
    # of their rounds clipped, down to 0.083, one at a time): two deep rounds among five, again and again, and
    # each twice in a row once, is never banned
    for i in range(50):
        assert table.record(honest, {2: 0.29, 4: 0.083}.get(i % 5, 1.0), now=float(i)) is False
    for i, scale in enumerate([1.0, 1.0, 1.0, 0.2, 0.17, 1.0]):
        assert table.record(honest, scale, now=50.0 + i) is False
    # a gradient times -8 scaled to 0.08-0.2 in each round: banned at its MIN_JUDGED-th round
    scales = [0.12, 0.2, 0.08, 0.15]
    banned = [table.record(attacker, scale, now=100.0 + i) for i, scale in enumerate(scales)]
    assert banned == [False] * (suspects.MIN_JUDGED - 1) + [True]
    assert table.banned_for(attacker, now=104.0) == suspects.BAN_SECONDS - 1
    assert table.banned_for(honest, now=104.0) == 0.0
    found = {s.peer: s for s in table.suspects(now=104.0)}
    assert (found[attacker].clipped, found[attacker].bans) == (4, 1)
    assert found[attacker].ban_scale == pytest.approx(0.1375)
    assert (found[honest].rounds, found[honest].clipped, found[honest].bans) == (56, 22, 0)
    # judged afresh after its ban: banned again after MIN_JUDGED more rounds, for twice as long
    after = 104.0 + suspects.BAN_SECONDS
    again = [table.record(attacker, 0.25, now=after + i) for i in range(suspects.MIN_JUDGED)]
    assert again == [False] * (suspects.MIN_JUDGED - 1) + [True]
    assert table.banned_for(attacker, now=after + 3) == 2 * suspects.BAN_SECONDS
    found = {s.peer: s for s in table.suspects(now=after + 3)}
    assert suspects.why_banned(found[attacker]) == (
        "its gradient was far from its groupmates' round after round (scaled to 0.25 on average over its "
        "last judged rounds; 8 of 8 rounds clipped) (ban 2, 600 s left)"
    )
    # a peer scaled to 0.4 round after round (a gradient times -4 beside noisy honest ones) is banned; one at
    # the average of the honest rounds above is not
    assert [table.record("12D3KooWx4", 0.4, now=200.0 + i) for i in range(4)][-1] is True
    assert not any(table.record("12D3KooWmid", 0.55, now=200.0 + i) for i in range(20))


def test_a_donor_whose_refused_state_shares_nothing_with_the_swarms_is_banned_at_once():
    """A download that the check refused (swarm/averaging/donors.py) for a state more than STATE_FAR of its
    norm from the one most peers published bans its donor at once, and says so; one refused for a smaller
    difference (an honest donor that holds another group's state) is not banned, however often."""
    table = suspects.Suspects()
    assert not any(table.served_far("12D3KooWhonest", 0.3, now=float(i)) for i in range(10))
    assert table.banned_for("12D3KooWhonest", now=10.0) == 0.0
    assert table.served_far("12D3KooWdonor", 1.41, now=20.0) is True
    assert table.served_far("12D3KooWdonor", 1.41, now=21.0) is False  # banned already
    (found,) = [s for s in table.suspects(now=21.0) if s.peer == "12D3KooWdonor"]
    assert found.banned_for == suspects.BAN_SECONDS - 1 and found.ban_served and found.bans == 1
    assert suspects.why_banned(found) == (
        "the state it served as a donor shared nothing with the one most peers published for its epoch "
        "(1.41 times its norm away) (ban 1, 299 s left)"
    )
    assert table.served_far("12D3KooWnan", float("nan"), now=30.0) is True  # not a number: far


def _group_round(noise: float, signs: list[float], seed: int, weights: list[float] | None = None):
    """(this peer's gradient, the weighted mean of a round whose other members send their own honest gradient
    times each of ``signs``); every gradient estimates one true gradient of norm 1, off by ``noise`` times."""
    gen = torch.Generator().manual_seed(seed)
    size = 100_000
    true = torch.randn(size, generator=gen) / size**0.5
    grads = [true + noise * torch.randn(size, generator=gen) / size**0.5 for _ in range(len(signs) + 1)]
    weights = weights or [1.0] * len(grads)
    sent = [grads[0]] + [sign * g for sign, g in zip(signs, grads[1:], strict=True)]
    mean = sum(w * g for w, g in zip(weights, sent, strict=True)) / sum(weights)
    return [grads[0]], [mean]


def test_a_larger_round_is_rejected_when_its_average_lies_far_from_the_peers_own_gradient():
    """A robust rule outvotes a minority only: two colluders in a group of three, or two in four (once an
    honest peer has banned them and left their groups), make the round's result theirs. The screen bounds
    it as in a round of two: an honest group's average lies between honest gradients, nearer this peer's own
    than the furthest of them, and passes at any noise, with this peer the smallest or the largest sender;
    a group of three whose two others send their gradient times -8 (their robust centre: the mean of the
    two), and one of four with two such, is rejected."""
    for noise in (0.1, 1.0, 4.0):  # the gradients' cosine: 0.99, 0.5, 0.06
        for seed in range(5):
            for size in (3, 4, 5):
                for weights in (None, [32.0] + [224.0] * (size - 1), [224.0] + [32.0] * (size - 1)):
                    own, averaged = _group_round(noise, [1.0] * (size - 1), seed, weights)
                    screen = RoundScreen(10.0)
                    judged = screen.judge_gradients(averaged, own, group_size=size)
                    assert judged is None, (noise, size, weights, judged)
                    assert screen.last_distance < 2.0, (noise, size, weights, screen.last_distance)
    for noise in (0.1, 1.0):
        own, two_of_three = _group_round(noise, [-8.0, -8.0], seed=7, weights=[0.0, 1.0, 1.0])
        reason = RoundScreen(10.0).judge_gradients(two_of_three, own, group_size=3)
        assert reason is not None and reason.startswith("in a round of 3, the averaged gradient lies"), noise
        own, two_of_four = _group_round(noise, [1.0, -8.0, -8.0], seed=7)
        reason = RoundScreen(10.0).judge_gradients(two_of_four, own, group_size=4)
        assert reason is not None and reason.startswith("in a round of 4, the averaged gradient lies"), noise
