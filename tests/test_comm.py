"""Communication-efficient modes, for correctness (never speed): each --compression mode through a real
averaging round of two gradient averagers on 127.0.0.1, and DiLoCo peers that end an outer step equal."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch

from swarm import patches
from swarm.compression import CompressionError, parse_compression
from swarm.patches import traffic
from swarm.procs import remove_stale_sockets
from swarm.waiting import wait_until
from tests.helpers import PeerProcess, read_summary


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _average_once(spec: str, grads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """One real all-reduce of each peer's gradients with ``spec``'s averager and wire format."""
    import hivemind

    comp = parse_compression(spec)
    patches.install()  # the traffic counter, and the 8-bit decoder that NumPy >= 2.4 needs
    started = time.time()
    dhts, averagers = [], []
    try:
        first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(first)
        for _ in grads[1:]:
            dhts.append(
                hivemind.DHT(
                    start=True,
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=[str(a) for a in first.get_visible_maddrs()],
                )
            )
        for dht, peer_grads in zip(dhts, grads, strict=True):
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in peer_grads]
            for p, g in zip(params, peer_grads, strict=True):
                p.grad = g.clone()
            factory = comp.grad_averager_factory(
                dht=dht,
                prefix=f"pytest-comm-{comp.mode}",
                compression=comp.grad_compression(),
                min_matchmaking_time=2.0,
                request_timeout=1.5,
                target_group_size=len(grads),
                start=True,
            )
            averagers.append((factory(params), params))
        for averager, _ in averagers:
            averager.accumulate_grads_(batch_size=1)
        results: list = [None] * len(averagers)
        sent_before = traffic.bytes_sent()

        def run(i: int) -> None:
            results[i] = averagers[i][0].step(timeout=30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None and len(r) == len(grads) for r in results), results
        _average_once.bytes_sent = traffic.bytes_sent() - sent_before  # both peers' averagers, this process
        out = []
        for averager, params in averagers:
            with averager.use_averaged_gradients():
                out.append([p.grad.detach().clone() for p in params])
        return out
    finally:
        for averager, _ in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)


def _gaussian(seed: int, rank: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        matrix = torch.randn(512, 256, generator=g)  # 131 072 numbers: above the 8-bit threshold
    else:
        matrix = torch.randn(512, rank, generator=g) @ torch.randn(rank, 256, generator=g) / math.sqrt(rank)
    return [matrix, torch.randn(256, generator=g)]


@pytest.mark.parametrize(
    ("spec", "low", "high", "wire_bytes"),
    [
        ("none", 0.0, 1e-6, 4),  # float32 throughout
        ("fp16", 1e-5, 1e-3, 2),  # float16 keeps 11 bits: ~2.4e-4 relative per rounding, two roundings
        ("int8", 1e-3, 2.5e-2, 1),  # 256 buckets over +-3 sigma, each decoded to its mean
    ],
)
def test_compressed_averaging_stays_within_its_expected_error(spec, low, high, wire_bytes):
    peers = [_gaussian(1), _gaussian(2)]
    want = [(a + b) / 2 for a, b in zip(*peers, strict=True)]
    averaged = _average_once(spec, peers)
    # each of the 2 peers sends the half it does not reduce, and gets it back averaged: 2 x numbers in all
    numbers = sum(t.numel() for t in peers[0])
    per_number = _average_once.bytes_sent / (2 * numbers)
    assert wire_bytes <= per_number <= wire_bytes * 1.15, (spec, per_number)
    for got in averaged:
        err = _rel_error(got[0], want[0])
        # low > 0: the mode really changed what was sent (an uncompressed round would be exact)
        assert low <= err <= high, (spec, err)
        assert torch.allclose(got[1], want[1], rtol=0, atol=1e-2 if spec == "int8" else 1e-3)  # small: fp16


def test_powersgd_is_exact_on_low_rank_gradients_and_lossy_on_full_rank_ones():
    """hivemind's PowerSGD averager draws each peer's starting Q with ``torch.rand`` from the global
    generator, and orthogonalises ``M @ Q`` in float32: how exact a low-rank round is depends on that draw
    (the same arithmetic on 400 draws: median 3.8e-6, 7 above 1e-4, the worst 4.7e-4, as Q's uniform columns
    are nearly parallel). The draw is fixed here, so that the check is the same in every run."""
    # gradients of rank 2 on each peer: their mean has rank <= 4, which a rank-4 factorisation holds exactly
    peers = [_gaussian(1, rank=2), _gaussian(2, rank=2)]
    want = [(a + b) / 2 for a, b in zip(*peers, strict=True)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        averaged = _average_once("powersgd:4", peers)
    for got in averaged:
        assert _rel_error(got[0], want[0]) < 1e-4, _rel_error(got[0], want[0])
        assert torch.allclose(got[1], want[1], atol=1e-6)  # vectors are averaged whole
    # full-rank gradients lose most of their energy in one round (error feedback returns it later)
    peers = [_gaussian(3), _gaussian(4)]
    want = [(a + b) / 2 for a, b in zip(*peers, strict=True)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        averaged = _average_once("powersgd:4", peers)
    for got in averaged:
        assert 0.5 < _rel_error(got[0], want[0]) < 1.0


def test_compression_specs_are_checked():
    assert parse_compression("powersgd:8").rank == 8
    for bad in ("zip", "powersgd", "powersgd:0", "int4"):
        with pytest.raises(CompressionError, match="none, fp16, int8, powersgd:<rank>"):
            parse_compression(bad)


OUTER = 12


def _bootstrap(peers, run, tmp_path) -> str:
    """A bootstrap peer of ``run`` (a DHT node that does not train); the address to join it at."""
    entry = PeerProcess(
        "entry",
        ["bootstrap", "--config", "demo", "--run-id", run, "--log-dir", str(tmp_path)],
        peers,
    )
    return entry.join_address(timeout=120)


def _diloco_peer(peers, name, run, tmp_path, *extra, seed):
    args = [
        "join",
        "--config",
        "demo",
        "--run-id",
        run,
        "--log-dir",
        str(tmp_path),
        "--peer-name",
        name,
        "--seed",
        str(seed),
        "--threads",
        "1",
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--averaging",
        "diloco",
        "--local-steps",
        "16",
        "--target-batch-size",
        "1024",  # 2 peers x 16 local steps x 32
        *extra,
    ]
    return PeerProcess(name, args, peers)


def _diloco_pair_to_the_end(peers, run, tmp_path, *extra) -> list:
    """Peers a and b of a new DiLoCo swarm ``run`` (seeds 0 and 1), with ``extra`` flags, once both ended."""
    address = _bootstrap(peers, run, tmp_path)
    flags = ("--initial-peers", address, "--min-peers", "2", *extra)
    pair = [_diloco_peer(peers, name, run, tmp_path, *flags, seed=i) for i, name in enumerate(("a", "b"))]
    for p in pair:
        assert p.wait(timeout=240) == 0, f"{p.name}:\n{p.output()[-4000:]}"
    return pair


def test_diloco_peers_end_each_outer_step_equal_and_a_newcomer_loads_inner_and_outer_state(peers, tmp_path):
    run = "pytest-diloco"
    address = _bootstrap(peers, run, tmp_path)
    # The swarm trains until the newcomer has loaded its state and trained 2 outer steps with it, and only
    # then is told to leave (SIGTERM, as a reclaimed machine is): with rounds that end in a fraction of a
    # second, a fixed number of outer steps ended before a newcomer that needs 10 to 30 s to come up on a
    # busy machine arrived (loaded_epoch 0, "failed to dial": the donors had left).
    common = ("--max-epochs", "100000", "--initial-peers", address)
    first = _diloco_peer(peers, "first", run, tmp_path, *common, seed=1)
    second = _diloco_peer(peers, "second", run, tmp_path, *common, seed=2)
    second.wait_for(r"\| epoch [2-9] \| peers 2", timeout=180)
    late = _diloco_peer(peers, "late", run, tmp_path, *common, seed=3)
    joined = int(
        late.wait_for(r"Loaded the swarm's state from peers: global epoch (\d+)", timeout=180).group(1)
    )
    # ... and until the two donors have ended an outer step together since, with one anchor, and the newcomer
    # has ended one with a donor's anchor: every outer step is the same averaged step on the same anchor. The
    # newcomer's first rounds can pass the donors in turn: in CI the groups toward epochs 16, 17 and 18 were
    # (first, late), (late, second), then all three, so the donors' anchors recorded before the signal were
    # those of 16 and 18 against 15 and 17 (second recorded its 18 after the signal), all of them right, none
    # in common. Compared by value, not by epoch number: a round that stalls while the newcomer joins can
    # leave the peers' epoch counters one apart (seen: first's epoch 5 equal to second's epoch 6, both after
    # the same 3-peer round).
    trio = (first, second, late)

    def anchors(name: str) -> dict[int, list[float]]:
        """The anchors ``name`` recorded after the outer steps it ended with a group since the join."""
        try:
            s = read_summary(tmp_path, run, name)
        except FileNotFoundError:
            return {}
        averaged = [
            h["epoch"]
            for h in s["history"]
            if h["epoch"] > joined
            and h.get("round", {}).get("outcome") == "averaged"
            and h["round"]["group"] >= 2
        ]
        return {e: s["checksums"][str(e)] for e in averaged if str(e) in s["checksums"]}

    def shared(x: dict[int, list[float]], y: dict[int, list[float]]) -> bool:
        return any(u == pytest.approx(v, rel=1e-6) for u in x.values() for v in y.values())

    def together() -> bool:
        mine, theirs, new = anchors("first"), anchors("second"), anchors("late")
        return shared(mine, theirs) and (shared(new, mine) or shared(new, theirs))

    assert wait_until(lambda: min(p.epoch() for p in trio) >= joined + 2 and together(), timeout=120), (
        {n: anchors(n) for n in ("first", "second", "late")},
        {p.name: p.output()[-2000:] for p in trio},
    )
    for p in (first, second, late):
        os.killpg(p.pgid, signal.SIGTERM)
    for p in (first, second, late):
        assert p.wait(timeout=60) == 0, f"{p.name}:\n{p.output()[-4000:]}"
    a, b, c = (read_summary(tmp_path, run, n) for n in ("first", "second", "late"))
    assert a["outer_steps"] >= 3 and b["outer_steps"] >= 3, (a["outer_steps"], b["outer_steps"])
    # and they trained between outer steps: the anchor moved at every recorded outer step but at most one
    # (a peer whose epoch counter catches up after a stalled round records the same anchor twice: seen in a
    # fresh clone, first's epochs 7 and 8 equal within 6e-8 relative, both equal to second's epoch 8)
    for s in (a, b):
        anchors = [s["checksums"][str(h["epoch"])] for h in s["history"] if str(h["epoch"]) in s["checksums"]]
        repeats = sum(x == pytest.approx(y, rel=1e-6) for x, y in zip(anchors, anchors[1:], strict=False))
        assert len(anchors) >= 3 and repeats <= 1, anchors
    # an honest swarm's averaged pseudo-gradients pass every peer's screen, the newcomer's too: it joins its
    # first outer round after a few inner steps, with a pseudo-gradient many times shorter than the others'
    # (before DiLoCo.pseudo_gradient_scale it rejected that round: "rejected: ['gradient']")
    screened = {p.name: s["rejected_gradient_rounds"] for p, s in zip(trio, (a, b, c), strict=True)}
    assert not any(screened.values()), (screened, late.output()[-3000:])
    # the newcomer started from the swarm's anchor with the swarm's outer momentum and inner AdamW moments
    loaded = c["diloco_loaded"]
    assert (
        c["loaded_epoch"] >= 2 and loaded["outer_momentum_norm"] > 0 and loaded["inner_exp_avg_sq_sum"] > 0
    ), (c["loaded_epoch"], loaded, late.output()[-3000:])
    # the newcomer holds a donor's anchor of the epoch it announced, exactly: a donor serves its state only
    # between epoch steps (docs/hivemind-patches.md item 4). Before that rule, a download during the donor's
    # step got the new epoch's number with the donor's own update before the group's average (seen: 404.85
    # between 406.06 at the epoch it announced and 395.24 at the next). Each peer's own init is far from any
    # anchor.
    loaded_at = str(c["loaded_epoch"])
    anchors = [s["checksums"][loaded_at] for s in (a, b) if loaded_at in s["checksums"]]
    assert any(c["start_checksum"] == pytest.approx(x, rel=1e-6) for x in anchors), (
        loaded_at,
        c["start_checksum"],
        anchors,
        late.output()[-4000:],
    )


def test_diloco_peers_that_overlap_rounds_train_through_them_and_share_each_anchor(peers, tmp_path):
    """--overlap-rounds: two DiLoCo peers hand each outer round to the background and go on with inner
    steps. They still take the same averaged outer step on the same anchor (equal anchors at a common
    epoch), each round's time in the background is recorded and is more than the trainer waited for the
    rounds (landing a round moves the parameters, nothing more), the loss falls, and they leave together
    once both say they ended."""
    run = "pytest-diloco-overlap"
    pair = _diloco_pair_to_the_end(peers, run, tmp_path, "--max-epochs", "6", "--overlap-rounds")
    a, b = (read_summary(tmp_path, run, n) for n in ("a", "b"))
    out = {p.name: p.output()[-2500:] for p in pair}
    assert a["overlap_rounds"] and b["overlap_rounds"], out
    common_epochs = [e for e in a["checksums"] if e in b["checksums"] and int(e) > 0]
    equal = [e for e in common_epochs if a["checksums"][e] == pytest.approx(b["checksums"][e], rel=1e-6)]
    assert len(equal) >= 2, (common_epochs, a["checksums"], b["checksums"], out)
    for s in (a, b):
        averaged = [r for r in s["rounds"] if r["outcome"] == "averaged" and r["group"] == 2]
        assert len(averaged) >= 2, (s["rounds"], out)
        background = s["seconds_of_rounds_in_background"]
        waited = sum(r["end"] for r in s["rounds"])
        assert background == pytest.approx(sum(r["flight"] for r in s["rounds"]), abs=0.05), s["rounds"]
        assert waited < background, (waited, background, s["rounds"])
        assert s["last_loss"] < s["first_loss"], (s["first_loss"], s["last_loss"])
        assert not s["rejected_gradient_rounds"], out
    # no monitor: they shared their final state until every record said it was final (each peer's last
    # round landed), not for the whole linger, nor less (one that left at once stranded the other's round)
    ended = "Every peer ended at global epoch 6 and no monitor is there; leaving now"
    assert any(ended in line for p in pair for line in p.lines), out


def test_diloco_peers_that_match_early_find_their_group_while_they_compute(peers, tmp_path):
    """--match-early with rounds paced by time (2 s) and in the background: a peer looks for its group
    once the swarm's estimated end of the phase is near, so most averaged rounds of the two peers find their
    group already assembled when the phase ends (matchmaking under 10 ms in the round's record). Without it a
    group forms only after the phase ends: 70-330 ms of matchmaking in every round on loopback."""
    run = "pytest-diloco-early"
    pair = _diloco_pair_to_the_end(
        peers, run, tmp_path, "--max-epochs", "8", "--round-seconds", "2", "--overlap-rounds", "--match-early"
    )
    for name, p in zip(("a", "b"), pair, strict=True):
        s = read_summary(tmp_path, run, name)
        averaged = [r for r in s["rounds"] if r["outcome"] == "averaged" and r["group"] == 2]
        early = [r for r in averaged if r["matchmaking"] < 0.01]
        assert len(averaged) >= 4 and 2 * len(early) >= len(averaged), (s["rounds"], p.output()[-2500:])
        assert not s["rejected_gradient_rounds"], p.output()[-2500:]


def test_diloco_peers_with_int8_pseudo_gradients_stay_in_agreement_and_skip_state_rounds(peers, tmp_path):
    """Two DiLoCo peers with int8 pseudo-gradients and a state round due every 2nd epoch. The second
    downloads its state from the first as it starts (float32, whatever --compression says), and every
    outer round ends with the same averaged pseudo-gradient in both (the reducers answer with the average
    itself, docs/hivemind-patches.md item 35), so their anchors stay equal and the state rounds are skipped
    in agreement. Before, each added its own rounding of its difference from the average, and a download
    came as float16: the anchors parted by about 1e-5 of their norm within a few rounds, and every state
    round ran.

    A round can end partial: in a fresh-clone suite one peer's parts stopped for next_chunk_timeout (10 s),
    and each kept its own numbers for the missing share (record: ``partial``; 51-55 % received), 6.7e-4
    apart. The state rounds that follow join them again (item 36: before, each float16 state round left each
    peer its own rounding of its weights, 2e-4 of their norm apart, and the peers never agreed again)."""
    run = "pytest-diloco-int8"
    pair = _diloco_pair_to_the_end(
        peers, run, tmp_path, "--max-epochs", "8", "--compression", "int8", "--average-state-every", "2"
    )
    a, b = (read_summary(tmp_path, run, n) for n in ("a", "b"))
    out = {p.name: p.output()[-2500:] for p in pair}
    sums = [{int(e): c for e, c in s["checksums"].items()} for s in (a, b)]
    common_epochs = sorted(e for e in sums[0] if e in sums[1])
    apart = {
        e: max(abs(x - y) / abs(x) for x, y in zip(sums[0][e], sums[1][e], strict=True))
        for e in common_epochs
    }
    outcomes = {s["peer_name"]: {r["epoch"]: r["outcome"] for r in s["rounds"]} for s in (a, b)}
    partial = sorted(e for o in outcomes.values() for e, outcome in o.items() if outcome == "partial")
    assert len(common_epochs) >= 6 and common_epochs[0] == 0 and apart[0] == 0.0, (apart, out)
    for e in common_epochs[1:]:  # a round that both ended whole leaves two equal anchors equal
        whole = all(o.get(e) == "averaged" for o in outcomes.values())
        if whole and apart.get(e - 1, 1.0) < 1e-6:
            assert apart[e] < 1e-6, (e, apart, outcomes, out)
    assert apart[common_epochs[-1]] < 1e-6, (apart, outcomes, out)  # a state round mends a partial one
    for s in (a, b):
        averaged = [r for r in s["rounds"] if r["outcome"] == "averaged" and r["group"] == 2]
        assert len(averaged) >= 6, (s["rounds"], out)
        # a partial round holds the next state round, and that one can leave the anchors a little over
        # AGREEMENT_RTOL apart, so the one after runs too: one partial round costs 2 of the 4 skips at most
        skipped = s["round_ends"]["state_skipped_in_agreement"]
        assert skipped >= (2 if partial else 3), (partial, s["round_ends"], s["rounds"], out)
        assert not s["rejected_gradient_rounds"], out
