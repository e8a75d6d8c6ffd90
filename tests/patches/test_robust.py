"""What swarm/patches/robust.py changes (item 21): the peer that reduces a slice of a round takes a robust
mean (CenteredClip) of its groupmates' parts instead of their weighted mean. Three real averagers on three
DHT nodes average one vector each; every scenario runs with hivemind's weighted mean and with the robust
mean. Both variants have item 8 installed (swarm/patches/allreduce.py), so that they differ in the reducer
alone: without it, a reducer starved for longer than ``request_timeout`` refuses a groupmate's part, and the
round ends on some of the numbers (a rare fresh-clone failure of the x -8 test)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from swarm import patches, suspects
from swarm.patches import matchmaking, robust
from tests.patches.common import MATCHMAKING, _vector_averagers, round_results

NODES = 3
MEAN_OR_ROBUST = pytest.mark.parametrize("patched", [False, True], ids=["hivemind's mean", "robust mean"])
SIZE = 60_000  # numbers per peer: split into the three peers' slices, each reduced by one of them


def _round(
    nodes, patched: bool, vectors: list, weights: list[float], prefix: str
) -> tuple[torch.Tensor, int]:
    """One all-reduce of ``vectors`` (one per averager, with ``weights``): (what every averager then holds
    (they must all hold the same, but for float32 rounding: each adds the average's change to its own), the
    senders' parts that the reducers scaled down)."""
    before = robust.clipped_parts()
    # the averager processes fork with the reducer as it is now
    with patches.installed("allreduce", *(("robust",) if patched else ())):
        # the shared nodes keep the other variant's records: one prefix each
        group = _vector_averagers(nodes(3), vectors, f"{prefix}-{patched}")
    try:
        pairs = zip(group, weights, strict=True)
        controls = [a.step(weight=w, wait=False, timeout=MATCHMAKING + 10) for a, w in pairs]
        round_results(controls, 3)
        held = []
        for averager in group:
            with averager.get_tensors() as got:
                held.append(got[0].clone())
    finally:
        for averager in group:
            averager.shutdown()
    for other in held[1:]:
        torch.testing.assert_close(other, held[0], rtol=1e-5, atol=1e-8)
    return held[0], robust.clipped_parts() - before


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def _gradients(
    seed: int, count: int, noise: float, size: int = SIZE
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The true gradient (norm 1) and ``count`` honest estimates of it, each off by ``noise`` times its
    norm."""
    gen = torch.Generator().manual_seed(seed)
    true = torch.randn(size, generator=gen) / size**0.5
    return true, [true + noise * torch.randn(size, generator=gen) / size**0.5 for _ in range(count)]


@MEAN_OR_ROBUST
def test_an_honest_round_gives_the_weighted_mean(nodes, patched):
    """Three honest peers, one with half the samples of the others: both variants give the weighted mean
    (float32 rounding: the patch reduces in a different order)."""
    _, vectors = _gradients(seed=1, count=3, noise=1.0)
    weights = [64.0, 64.0, 32.0]
    expected = sum(v * w for v, w in zip(vectors, weights, strict=True)) / sum(weights)
    got, clipped = _round(nodes, patched, vectors, weights, "pytest-robust-honest")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert clipped == 0


@MEAN_OR_ROBUST
@pytest.mark.parametrize("weight", [64.0, 1e6], ids=["its own weight", "a weight of 10^6"])
def test_a_peer_sending_its_gradient_times_minus_8_cannot_turn_the_round_uphill(nodes, patched, weight):
    """Two honest peers and one that sends its honest gradient times -8 (of a size the round screen lets
    through), announcing its true weight or 10^6 samples. hivemind's mean points uphill; the robust mean
    points the honest way (the honest pair's mean has cosine 0.94 with the true gradient)."""
    true, (a, b, c) = _gradients(seed=2, count=3, noise=0.5)
    honest = (a + b) / 2
    got, clipped = _round(
        nodes, patched, [a, b, -8 * c], [64.0, 64.0, weight], f"pytest-robust-flip-{weight:g}"
    )
    assert _cos(honest, true) > 0.9
    if patched:
        assert _cos(got, true) > 0.8, _cos(got, true)
        assert (got - honest).norm() < 0.5 * honest.norm()
        assert clipped >= 1  # the attacker's part of each slice (load balancing decides how many slices)
    else:
        assert _cos(got, true) < -0.6, _cos(got, true)
        assert clipped == 0


def test_a_peer_clipped_round_after_round_is_banned_and_left_out_of_the_next_groups(nodes, monkeypatch):
    """swarm/suspects.py on real averagers: two honest peers and one that sends its gradient times
    -8 average round after round. The honest reducers clip the attacker's parts each round; once its last
    MIN_JUDGED judged scales average below BAN_BELOW, it is banned: the next round's group is the two honest
    peers (the attacker's requests are refused, and nobody calls it). The three averagers here share one
    table (they are forked from this process, as a peer's own averagers share theirs), so each round the
    attacker is judged by both honest reducers: banned after MIN_JUDGED / 2 rounds."""
    monkeypatch.setattr(robust, "_SCORING", True)  # as in a gradient averager's process
    # large enough that each of the three reduces a slice (hivemind gives a small vector to one reducer)
    _, (a, b, c) = _gradients(seed=5, count=3, noise=0.5, size=1_200_000)
    vectors = [a, b, -8 * c]
    with patches.installed():
        table = robust.suspects()
        table.clear()
        group = _vector_averagers(nodes(3), vectors, "pytest-robust-ban")
        try:
            attacker = str(group[2].peer_id)
            rounds = 0
            while table.banned_for(attacker) == 0:
                assert rounds < suspects.MIN_JUDGED, table.suspects()
                for averager, vector in zip(group, vectors, strict=True):
                    with averager.get_tensors() as held:
                        held[0].copy_(vector)
                controls = [x.step(weight=64.0, wait=False, timeout=MATCHMAKING + 10) for x in group]
                round_results(controls, 3)
                rounds += 1
            assert rounds == suspects.MIN_JUDGED // 2  # two judges a round
            (found,) = table.suspects()  # the honest peers: never clipped
            assert found.peer == attacker and found.ban_scale < suspects.BAN_BELOW and found.bans == 1, found
            assert suspects.BAN_SECONDS - 60 < found.banned_for <= suspects.BAN_SECONDS
            sent: dict = {}
            for averager in group[:2]:
                matchmaking.set_target_group_size(averager, 2, sent)
            # the attacker looks too (for a group of 3 that it will not find); the honest groups close at 2
            controls = [x.step(weight=64.0, wait=False, timeout=MATCHMAKING + 10) for x in group]
            honest = {str(x.peer_id) for x in group[:2]}
            for control in controls[:2]:
                assert {str(p) for p in control.result(timeout=MATCHMAKING - 5)} == honest
        finally:
            for averager in group:
                averager.shutdown()
            table.clear()


def test_a_reducer_outvoted_in_its_round_judges_nobody(monkeypatch):
    """hivemind's reducer as swarm/patches/robust.py replaces it, fed one slice by three senders. Two honest
    senders and a gradient times -8: the reducer (an honest one) judges the attacker far and the other honest
    sender close. Two colluders that send the same gradient times -8 and one honest sender: the colluders are
    the round's majority, so the rule scales the honest part down (the reducer's own) and theirs not at all;
    the reducer judges nobody rather than count the colluders as honest. In both rounds it notes the senders
    whose parts lay far from its own (more than FAR_FROM_OWN times its norm away): the gradients times -8,
    not the honest one (the round screen decides: swarm/patches/optimizer.py ``_judge_far``)."""
    import asyncio

    monkeypatch.setattr(robust, "_SCORING", True)  # as in a gradient averager's process
    monkeypatch.setattr(robust, "_suspects", suspects.Suspects())
    monkeypatch.setattr(robust, "RULE", "centered_clip")
    _, (a, b, c) = _gradients(seed=7, count=3, noise=0.5, size=10_000)
    reducer_class = robust._reducer_class(None)

    async def reduce(parts: list[torch.Tensor]) -> None:
        reducer = reducer_class([a.shape], 3)
        reducer.sender_peer_ids, reducer.own_peer_id = ["own", "second", "third"], "own"
        await asyncio.gather(*(reducer.accumulate_part(i, 0, part, 64.0) for i, part in enumerate(parts)))
        assert reducer.finished.is_set()

    asyncio.run(reduce([a, b, -8 * c]))
    table = robust.suspects()
    scales = {s.peer: s.recent_scale for s in [table.get("second"), table.get("third")]}
    assert scales["second"] == 1.0 and scales["third"] < 0.2, scales
    assert [table.far_rounds(peer) for peer in ("second", "third")] == [0, 1]
    asyncio.run(reduce([a, -8 * c, -8 * c]))
    assert [table.get(peer).rounds for peer in ("second", "third")] == [1, 1]
    assert [table.far_rounds(peer) for peer in ("second", "third")] == [1, 2]


def test_centered_clip_figures():
    """The rule itself, on rows of 131,072 numbers: an honest set of 3 gives its mean to float32 rounding; two
    rows give their weighted mean whatever they hold; rows at weight 0 take no part; weights above the median
    count as the median."""
    _, rows = _gradients(seed=3, count=3, noise=2.0)
    stacked = torch.stack(rows)
    got, scale = robust.centered_clip(stacked, torch.ones(3))
    torch.testing.assert_close(got, stacked.mean(0), rtol=1e-5, atol=1e-7)
    assert scale.tolist() == [1.0, 1.0, 1.0]
    pair = torch.stack([rows[0], -100 * rows[1]])
    got, _ = robust.centered_clip(pair, torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(got, (3 * rows[0] - 100 * rows[1]) / 4)
    got, _ = robust.centered_clip(torch.stack([*rows, 1e9 * rows[0]]), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(got, stacked.mean(0), rtol=1e-5, atol=1e-7)
    # most rows equal (parameters of peers in step, one that is not): their value, the other scaled to 0
    got, scale = robust.centered_clip(torch.stack([rows[0], rows[0], rows[1]]), torch.ones(3))
    assert torch.equal(got, rows[0]) and scale.tolist() == [1.0, 1.0, 0.0]
    assert robust.capped_weights(torch.tensor([1.0, 2.0, 1e6, 0.0])).tolist() == [1.0, 2.0, 2.0, 0.0]
    # senders are judged allowing a smaller batch its noise: 32 samples against a median of 128 is half as
    # far again (the square root of 4), so its scale counts twice; at or above the median, as it is
    judged = robust._judged_scales(torch.tensor([0.3, 0.3, 0.3]), torch.tensor([32.0, 128.0, 1e6]))
    torch.testing.assert_close(judged, torch.tensor([0.6, 0.3, 0.3]))
    with pytest.raises(ValueError, match="unknown aggregation rule 'median'; use one of centered_clip, mean"):
        robust.use("median")


def test_parts_far_outside_pull_the_result_not_at_all(monkeypatch):
    """Three honest gradients and two that are honest ones times -8 (two colluders of five): CenteredClip
    scales the two to tau from the centre, yet each still pulls it that far uphill (about 0.4 tau together,
    every round). Parts scaled below CUT take no part once the iteration ends: the result is the honest
    parts' mean, and both are still scaled below CUT (so their senders are judged as before). Not in a slice
    of fewer than CUT_NUMBERS numbers, where honest parts can lie far apart. Without the cut
    (CUT 0) the same round lies over a third of the honest mean's norm away from it, toward the attackers."""
    true, rows = _gradients(seed=4, count=5, noise=1.0)
    honest = torch.stack(rows[:3]).mean(0)
    parts = torch.stack([*rows[:3], -8 * rows[3], -8 * rows[4]])
    got, scale = robust.centered_clip(parts, torch.ones(5))
    torch.testing.assert_close(got, honest, rtol=1e-4, atol=1e-6)
    assert scale[:3].tolist() == [1.0, 1.0, 1.0] and bool((scale[3:] < robust.CUT).all()), scale
    few, _ = robust.centered_clip(parts[:, :100], torch.ones(5))  # a slice of 100 numbers: not cut
    monkeypatch.setattr(robust, "CUT", 0.0)
    clipped, same = robust.centered_clip(parts, torch.ones(5))
    assert same[:3].tolist() == [1.0, 1.0, 1.0] and bool((same[3:] < 0.5).all()), same
    assert torch.equal(robust.centered_clip(parts[:, :100], torch.ones(5))[0], few)
    assert float((clipped - honest).norm()) > float(honest.norm()) / 3, (clipped - honest).norm()
    assert _cos(clipped - honest, true) < -0.3  # the pull is uphill


def test_an_honest_gradient_of_a_large_norm_does_not_let_two_colluders_of_five_through(monkeypatch):
    """Honest gradients of small batches differ in norm several times over (in the demo's late rounds, 0.09
    to 0.90 within one slice). Three honest gradients, one of them three times the others' norm, and two
    honest ones times -8: tau comes from the median distance of the nearest majority (the second smallest
    of five), so the large honest part is clipped a little and the two are left out; the result points as
    the honest ones do. With tau from the median of all five distances (the large honest part's), the two
    lie within 2 tau, are only clipped, and turn the result uphill. The nearest majority of parts always
    stays in: an honest part four times the others' norm, beyond 2 tau, is clipped, not left out, and the
    result still points the honest way."""
    true, rows = _gradients(seed=4, count=5, noise=1.0)
    for big, kept_scale in ((3.0, 0.7), (4.0, robust.CUT)):
        parts = torch.stack([rows[0], rows[1], big * rows[2], -8 * rows[3], -8 * rows[4]])
        got, scale = robust.centered_clip(parts, torch.ones(5))
        assert _cos(got, true) > 0.8, (big, _cos(got, true))
        assert scale[:2].tolist() == [1.0, 1.0] and float(scale[2]) >= kept_scale, (big, scale)
        assert bool((scale[3:] < robust.CUT).all()), (big, scale)
    monkeypatch.setattr(robust, "_majority_distance", lambda distances: float(distances.median()))
    got, scale = robust.centered_clip(parts, torch.ones(5))
    assert _cos(got, true) < 0 and bool((scale[3:] >= robust.CUT).all()), (_cos(got, true), scale)


def test_two_colluders_of_five_that_announce_the_median_weight_are_still_a_minority():
    """Two colluders of five that announce as many samples as the round's median (weights capped there: 96,
    96) while the honest peers' batches are small (32, 32, and one of 160, capped to 96) hold more than half
    the weight. The parts that stay in are the nearest majority by count: both x-8 parts are left out and the
    result points the honest way (kept until the nearest held more than half the weight, one of them stayed,
    and the result's cosine with the true gradient was 0.25 against 0.83)."""
    true, rows = _gradients(seed=4, count=5, noise=1.0)
    parts = torch.stack([rows[0], rows[1], rows[2], -8 * rows[3], -8 * rows[4]])
    weights = torch.tensor([32.0, 32.0, 160.0, 96.0, 192.0])
    assert float(robust.capped_weights(weights)[3:].sum()) > float(robust.capped_weights(weights).sum()) / 2
    got, scale = robust.centered_clip(parts, weights)
    assert _cos(got, true) > 0.8, _cos(got, true)
    assert scale[:3].tolist() == [1.0, 1.0, 1.0] and bool((scale[3:] < robust.CUT).all()), scale
    capped = robust.capped_weights(weights)
    torch.testing.assert_close(got, (capped[:3] @ parts[:3]) / capped[:3].sum(), rtol=1e-4, atol=1e-6)


def test_groupmates_far_from_this_peer_in_a_round_the_screen_rejects_are_judged(monkeypatch):
    """A round of three whose two others sent parts far from this peer's own (two colluders: the reducer
    noted them, swarm/suspects.py) and whose result the round screen rejected for its distance from this
    peer's own gradient: each of the two gets a judged round, scored as the other of a round of two would be;
    four such rounds ban them (where such a round judged nobody, or credited them as close, a peer that two
    colluders held in their groups rejected every round and never banned them: the attack bench's 3 honest /
    2 attackers row). A round whose result the screen accepts, or a groupmate not noted far in it, counts
    nothing."""
    from swarm.averaging.screen import RoundScreen
    from swarm.patches.optimizer import _judge_far

    table = suspects.Suspects()
    monkeypatch.setattr(robust, "_suspects", table)
    own, colluders = "own", ["colluder-1", "colluder-2"]
    group, seen = [own, *colluders], {}
    gen = torch.Generator().manual_seed(9)
    mine = torch.randn(10_000, generator=gen)
    honest = mine + torch.randn(10_000, generator=gen)
    for round_ in range(suspects.MIN_JUDGED):
        screen = RoundScreen(10.0)
        for peer in colluders:
            table.noted_far(peer)
        reason = screen.judge_gradients([-8 * honest], [mine], group_size=3)
        assert reason is not None and screen.last_distance > 3, screen.last_distance
        _judge_far(group, own, screen, True, seen)
        for peer in colluders:
            found = table.get(peer)
            assert found.rounds == found.clipped == round_ + 1, found  # each scored below SUSPECT_SCALE
    assert all(table.banned_for(peer) > 0 for peer in colluders)

    table.clear()
    seen.clear()
    screen = RoundScreen(10.0)
    table.noted_far(colluders[0])  # far, but the result is honest: accepted, nobody judged
    assert screen.judge_gradients([honest], [mine], group_size=3) is None
    _judge_far(group, own, screen, False, seen)
    assert table.get(colluders[0]).rounds == 0 and table.get(colluders[1]) is None
    screen.judge_gradients([-8 * honest], [mine], group_size=3)  # rejected, and nobody noted far in it
    _judge_far(group, own, screen, True, seen)
    assert table.get(colluders[0]).rounds == 0 and table.get(colluders[1]) is None


def test_a_state_that_shares_nothing_with_this_peers_is_banned_after_far_states_rounds(monkeypatch):
    """A state averager's reducer (swarm/patches/robust.py, as ``judge_states_here`` sets it in the averager's
    process), fed one slice by three senders: this peer's state, a groupmate's that stepped alone for a while
    (within a few hundredths of the norm), and random numbers of the same norm (about 1.41 times the norm
    away). The random sender gets a far state round each round and is banned after FAR_STATES in a row; the
    honest groupmate never. A near round ends a run of far ones. A peer whose own state went astray (the two
    others hold one state, far from its own) judges nobody. Only parameters are measured: a peer's optimizer
    statistics differ from its groupmates' by much more than its parameters after it stepped alone."""
    import asyncio

    from hivemind.compression import TensorRole

    table = suspects.Suspects()
    monkeypatch.setattr(robust, "_STATES", True)
    monkeypatch.setattr(robust, "_suspects", table)
    monkeypatch.setattr(robust, "RULE", "centered_clip")
    gen = torch.Generator().manual_seed(11)
    mine = torch.randn(10_000, generator=gen)
    stepped = mine + 0.03 * torch.randn(10_000, generator=gen)
    reducer_class = robust._reducer_class(None)

    def reduce(parts: list[torch.Tensor], role: TensorRole = TensorRole.PARAMETER) -> dict[str, float]:
        async def run():
            reducer = reducer_class([mine.shape], 3)
            reducer.sender_peer_ids, reducer.own_peer_id = ["own", "honest", "random"], "own"
            reducer.parameter_parts = [role == TensorRole.PARAMETER]
            await asyncio.gather(*(reducer.accumulate_part(i, 0, p, 1.0) for i, p in enumerate(parts)))
            assert reducer.finished.is_set()
            return robust.state_gaps(reducer)

        return asyncio.run(run())

    def random_state() -> torch.Tensor:
        noise = torch.randn(10_000, generator=gen)
        return noise * mine.norm() / noise.norm()

    assert reduce([mine, stepped, random_state()], TensorRole.OPTIMIZER) == {}  # statistics: not measured
    assert table.get("random") is None
    gaps = reduce([mine, stepped, random_state()])
    assert gaps["honest"] < 0.05 and 1.3 < gaps["random"] < 1.5, gaps
    reduce([mine, stepped, stepped])  # a near round: the run of far rounds starts again
    assert table.get("random").clipped == 1 and table.banned_for("random") == 0
    for _ in range(suspects.FAR_STATES):
        assert table.banned_for("random") == 0
        reduce([mine, stepped, random_state()])
    found = table.get("random")
    assert table.banned_for("random") > 0 and found.ban_gap > suspects.STATE_FAR, found
    assert "state rounds" in suspects.why_banned(found)
    assert table.get("honest").clipped == 0 and table.banned_for("honest") == 0

    table.clear()
    astray = random_state()
    for _ in range(suspects.FAR_STATES + 1):
        gaps = reduce([astray, stepped, stepped])  # this peer's own state is the odd one
        assert min(gaps.values()) > suspects.STATE_FAR, gaps
    assert table.get("honest") is None and table.get("random") is None


def test_a_peer_that_sends_random_parameters_in_state_rounds_is_banned_and_left_out(nodes):
    """swarm/suspects.py's state rule on real state averagers (the swarm's class, whose process judges states
    where there are no extra tensors): two honest peers that hold one state and one that sends random
    numbers of the same norm in every state round. The honest reducers note it far each round; after
    FAR_STATES such notes (the three averagers share one table, as a peer's own averagers do: two judges a
    round) it is banned. While it takes part, every member ends a round with the honest state (the rule's
    result where most parts are equal); once banned, the honest peers average in a group of two without it
    (their reducers note it no more)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.patches.common import _state_averagers

    torch.manual_seed(3)
    nets = [torch.nn.Linear(1000, 1200) for _ in range(3)]  # large enough that each reduces a slice
    with torch.no_grad():
        for p, q in zip(nets[1].parameters(), nets[0].parameters(), strict=True):
            p.copy_(q)
    honest_state = [p.detach().clone() for p in nets[0].parameters()]

    def randomize() -> list[torch.Tensor]:
        with torch.no_grad():
            for p in nets[2].parameters():
                noise = torch.randn_like(p)
                p.copy_(noise * p.norm() / noise.norm())
        return [p.detach().clone() for p in nets[2].parameters()]

    def holds(net: torch.nn.Module, state: list[torch.Tensor]) -> bool:
        return all(torch.allclose(p.detach(), s) for p, s in zip(net.parameters(), state, strict=True))

    with patches.installed():
        table = robust.suspects()
        table.clear()
        group = _state_averagers(
            nodes(3), nets, "pytest-robust-state-ban",
            min_matchmaking_time=MATCHMAKING, request_timeout=1.5, target_group_size=3,
        )  # fmt: skip
        try:
            attacker, rounds = str(group[2].peer_id), 0

            def one_round(timeouts: list[float]) -> None:
                with ThreadPoolExecutor(len(group)) as pool:
                    steps = [
                        pool.submit(a.step, averaging_round=True, averaging_opts=dict(timeout=t))
                        for a, t in zip(group, timeouts, strict=True)
                    ]
                    for step in steps:
                        step.result(timeout=MATCHMAKING + 20)

            while table.banned_for(attacker) == 0:
                assert rounds < suspects.FAR_STATES, table.suspects()
                randomize()
                one_round([MATCHMAKING + 10] * 3)
                assert all(holds(net, honest_state) for net in nets), "a round of all three"
                rounds += 1
            assert rounds == (suspects.FAR_STATES + 1) // 2  # two judges a round
            (found,) = table.suspects()
            assert found.peer == attacker and found.ban_gap > suspects.STATE_FAR, found
            sent: dict = {}
            for averager in group[:2]:
                matchmaking.set_target_group_size(averager, 2, sent)
            randomize()
            with torch.no_grad():  # B moves a little: a round of the two leaves both halfway
                for p in nets[1].parameters():
                    p.add_(0.01 * torch.randn_like(p))
            pairs = zip(nets[0].parameters(), nets[1].parameters(), strict=True)
            halfway = [(p.detach() + q.detach()) / 2 for p, q in pairs]
            one_round([MATCHMAKING + 10, MATCHMAKING + 10, 3.0])  # the attacker finds no group
            assert holds(nets[0], halfway) and holds(nets[1], halfway), "the honest peers averaged"
            assert table.get(attacker).clipped == found.clipped, "the banned peer was not in their round"
        finally:
            for averager in group:
                averager.shutdown()
            table.clear()


def _judging_reducer(monkeypatch) -> Callable[[list[torch.Tensor], list[str]], None]:
    """``reduce(parts, names)``: one slice reduced by the swarm's reducer class (CenteredClip) as a gradient
    averager's process reduces it, judging each sender (``names``; the first part is this peer's own, "own")
    into a fresh suspects table, ``robust.suspects()``."""
    import asyncio

    monkeypatch.setattr(robust, "_SCORING", True)  # as in a gradient averager's process
    monkeypatch.setattr(robust, "_suspects", suspects.Suspects())
    monkeypatch.setattr(robust, "RULE", "centered_clip")
    reducer_class = robust._reducer_class(None)

    async def reduced(parts: list[torch.Tensor], names: list[str]) -> None:
        reducer = reducer_class([parts[0].shape], len(parts))
        reducer.sender_peer_ids, reducer.own_peer_id = list(names), "own"
        await asyncio.gather(*(reducer.accumulate_part(i, 0, part, 64.0) for i, part in enumerate(parts)))
        assert reducer.finished.is_set()

    return lambda parts, names: asyncio.run(reduced(parts, names))


def test_a_sender_whose_gradient_points_against_the_reducers_own_is_banned_by_direction(monkeypatch):
    """A gradient times -1 has an honest size: CenteredClip among three does not clip it, so its scale never
    bans it. Its direction does: the reducer notes each groupmate's cosine with its own part, and a groupmate
    whose last DIR_SHORT_WINDOW cosines average DIR_SHORT_BELOW or less, or whose last DIR_WINDOW average
    DIR_BELOW or less, is banned, in rounds of three and of two alike. An honest groupmate (cosine about 0.34
    here, the median of the demo's honest slices) is not, in 200 rounds of three and 200 of two."""
    reduce = _judging_reducer(monkeypatch)

    table = robust.suspects()
    for seed in range(200):
        _, (a, b, c) = _gradients(seed=100 + seed, count=3, noise=1.4, size=2_000)
        reduce([a, b, -c], ["own", "honest", "flipped"])
        reduce([a, c], ["own", "alone"])  # a round of two: judged by direction as well
        flipped = table.get("flipped")
        if seed < suspects.DIR_SHORT_WINDOW - 1:
            assert flipped.bans == 0 and flipped.clipped == 0, flipped
        elif seed == suspects.DIR_SHORT_WINDOW - 1:  # cosines about -0.34: the short window's mean bans it
            assert flipped.bans == 1 and flipped.ban_direction <= suspects.DIR_SHORT_BELOW, flipped
            assert flipped.ban_window == suspects.DIR_SHORT_WINDOW, flipped
            assert "pointed against this peer's own" in suspects.why_banned(flipped)
            assert f"over its last {suspects.DIR_SHORT_WINDOW} judged" in suspects.why_banned(flipped)
    assert table.get("honest").bans == 0 and table.get("alone").bans == 0, table.suspects()
    # the same gradient times -1 in rounds of two: banned after as many rounds
    for seed in range(suspects.DIR_SHORT_WINDOW):
        _, (a, b) = _gradients(seed=400 + seed, count=2, noise=1.4, size=2_000)
        reduce([a, -b], ["own", "paired"])
    assert table.get("paired").bans == 1, table.get("paired")
    # later in training honest cosines average 0.1-0.2 and a flip as far below zero: one about -0.2 (noise 2)
    # is banned by the mean of DIR_WINDOW, an honest groupmate at 0.05 (noise 4.4) is not in 200
    for seed in range(200):
        _, (a, b, c) = _gradients(seed=600 + seed, count=3, noise=2.0, size=20_000)
        _, (d, e) = _gradients(seed=900 + seed, count=2, noise=4.4, size=20_000)
        reduce([a, b, -c], ["own", "later", "flipped later"])
        reduce([d, e], ["own", "honest late"])
        late = table.get("flipped later")
        if seed < suspects.DIR_WINDOW - 1:
            assert late.bans == 0, (seed, late)
        elif seed == suspects.DIR_WINDOW - 1:
            assert late.bans == 1 and -0.25 < late.ban_direction <= suspects.DIR_BELOW, late
            assert late.ban_window == suspects.DIR_WINDOW, late
    assert table.get("later").bans == 0 and table.get("honest late").bans == 0, table.suspects()


def test_a_sender_whose_gradient_is_unrelated_to_the_reducers_own_is_banned(monkeypatch):
    """Random directions of an honest norm average a cosine of zero with this peer's gradient, as a flip does
    late in training, so the mean cannot tell them. Their spread can: a random direction's dot product with
    this peer's part lies within a few standard deviations of zero (the deviation it would have were its
    signs unrelated to ours), an honest gradient's much further, however noisy (it shares the descent
    direction). A groupmate whose last UNRELATED_ROUNDS dot products all lay within UNRELATED_Z of them is
    banned, in rounds of three and of two; honest groupmates whose cosines average 0.1 (as late in training
    in the demo) are not, in 200 rounds of each. The random direction has each tensor's honest norm, as the
    attack bench's has: a few large numbers do not make it look related."""
    reduce, size = _judging_reducer(monkeypatch), 20_000

    # two "tensors", the first 1,000 numbers 4 times larger than the rest: most of the sum of the squared
    # products lies in them, and an honest groupmate's dot product lies about 7 deviations from zero (the
    # demo's honest ones: a median of 12-14, lower late in training)
    scale = torch.ones(size)
    scale[:1_000] = 4.0
    tensors = (slice(0, 1_000), slice(1_000, size))

    def gradients(seed: int, count: int) -> list[torch.Tensor]:
        _, found = _gradients(seed=seed, count=count, noise=3.0, size=size)  # cosines about 0.1
        return [vector * scale for vector in found]

    def noise_like(vector: torch.Tensor, seed: int) -> torch.Tensor:
        """A random direction of ``vector``'s norm in each tensor (the attack bench's ``random_grad``)."""
        noise = torch.randn(vector.shape, generator=torch.Generator().manual_seed(seed))
        for part in tensors:
            noise[part] *= vector[part].norm() / noise[part].norm()
        return noise

    table, banned_at = robust.suspects(), None
    for seed in range(200):
        a, b, c = gradients(1_000 + seed, 3)
        reduce([a, b, noise_like(c, seed)], ["own", "honest", "random"])
        reduce([a, c], ["own", "alone"])
        randomised = table.get("random")
        if seed < suspects.UNRELATED_ROUNDS - 1:
            assert randomised.bans == 0, (seed, randomised)
        # a random direction's dot product lies beyond UNRELATED_Z now and then (0.3 % of rounds for a
        # normal one), which starts the count again: banned within twice the rounds
        banned_at = seed if randomised.bans and banned_at is None else banned_at
    assert banned_at is not None and banned_at < 2 * suspects.UNRELATED_ROUNDS, (banned_at, randomised)
    assert randomised.bans == 1 and randomised.ban_unrelated and randomised.ban_direction == 0.0, randomised
    assert "unrelated to this peer's own" in suspects.why_banned(randomised)
    assert table.get("honest").bans == 0 and table.get("alone").bans == 0, table.suspects()
    # in rounds of two, and where a random round now and then is followed by an honest one (the run resets)
    for seed in range(2 * suspects.UNRELATED_ROUNDS):
        a, b = gradients(3_000 + seed, 2)
        reduce([a, noise_like(b, seed)], ["own", "paired"])
        reduce([a, noise_like(b, seed) if seed % 4 else b], ["own", "sometimes"])
    assert table.get("paired").bans == 1 and table.get("sometimes").bans == 0, table.suspects()


def test_another_peers_ban_halves_the_evidence_of_unrelated_rounds(monkeypatch):
    """Where another peer publishes a ban of a groupmate (swarm/suspects.py ``saw_banned``), this peer's
    reducer bans it after SEEN_UNRELATED_ROUNDS unrelated rounds in a row (not UNRELATED_ROUNDS): its own
    rounds still decide. The bars of its cosines stay as they are (an attacker can publish bans of every
    honest peer): a flip is banned after as many rounds as without the word. An honest groupmate that an
    attacker accuses (cosines about 0.1, as late in training) is not banned in 200 rounds of three and of
    two."""
    reduce, size = _judging_reducer(monkeypatch), 20_000

    table, banned_at = robust.suspects(), {}
    for seed in range(200):
        for peer in ("random", "flipped", "accused", "accused-pair"):
            table.saw_banned(peer)  # as each read of the swarm's records does
        _, (a, b, c, d) = _gradients(seed=5_000 + seed, count=4, noise=3.0, size=size)  # cosines about 0.1
        noise = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * c.norm() / size**0.5
        reduce([a, b, noise], ["own", "accused", "random"])
        # a clear flip: cosines about -0.34, as a x -1 groupmate's early in training
        _, (e, f) = _gradients(seed=7_000 + seed, count=2, noise=1.4, size=size)
        reduce([e, -f], ["own", "flipped"])
        reduce([a, d], ["own", "accused-pair"])
        for peer in ("random", "flipped"):
            if table.get(peer).bans and peer not in banned_at:
                banned_at[peer] = seed
    # before UNRELATED_ROUNDS could have banned it (a random dot product beyond UNRELATED_Z starts the count
    # again now and then)
    assert suspects.SEEN_UNRELATED_ROUNDS - 1 <= banned_at.get("random", 99) < suspects.UNRELATED_ROUNDS - 1
    assert banned_at.get("flipped") == suspects.DIR_SHORT_WINDOW - 1, banned_at
    randomised, flipped = table.get("random"), table.get("flipped")
    assert randomised.ban_unrelated and randomised.ban_seen and not flipped.ban_seen, (randomised, flipped)
    assert "6 judged rounds in a row" in suspects.why_banned(randomised), suspects.why_banned(randomised)
    assert "and another peer banned it" in suspects.why_banned(randomised), suspects.why_banned(randomised)
    assert table.get("accused").bans == 0 and table.get("accused-pair").bans == 0, table.suspects()
    assert table.get("accused").seen_banned
