"""Faults on 127.0.0.1 with real peers: peers killed at chosen moments, the entry peer dying, a peer whose
numbers turn non-finite, and a newcomer whose model differs from the swarm's.

Faults are injected from inside the victim (``--inject-fault``, see swarm/faults.py), which prints one
``FAULT INJECTED`` line and then SIGKILLs its own process group, exactly as a reclaimed machine would die.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from pathlib import Path

import hivemind
import pytest

from swarm.net import metrics
from swarm.procs import group_members, is_p2p_daemon, p2p_daemons
from swarm.waiting import wait_until
from tests.helpers import PeerProcess, port_of, read_summary, synced_epochs

AVERAGING_TIMEOUT = 15.0  # configs/demo.yaml
NEAR = 2e-4  # relative: peers that averaged the same round (see test_swarm_localhost for the reason)


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=rel) for x, y in zip(a, b, strict=True))


def _finite(checksums: dict) -> bool:
    return all(math.isfinite(v) for pair in checksums.values() for v in pair)


def _common(run: str, log_dir: Path) -> list[str]:
    return [
        "--config",
        "demo",
        "--run-id",
        run,
        "--log-dir",
        str(log_dir),
        "--host-maddr",
        "/ip4/127.0.0.1/tcp/0",
    ]


def _bootstrap(peers: list, run: str, log_dir: Path) -> tuple[PeerProcess, str]:
    boot = PeerProcess("bootstrap", ["bootstrap", *_common(run, log_dir)], peers)
    return boot, boot.join_address(timeout=120)


def _join(peers: list, name: str, run: str, log_dir: Path, *extra: str, seed: int = 0) -> PeerProcess:
    args = [
        "join",
        *_common(run, log_dir),
        "--peer-name",
        name,
        "--seed",
        str(seed),
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--threads",
        "1",
        *extra,
    ]
    return PeerProcess(name, args, peers)


def _epoch_times(log_dir: Path, run: str, name: str) -> list[tuple[int, float]]:
    return [(h["epoch"], h["time"]) for h in read_summary(log_dir, run, name)["history"]]


def _recovery(survivors: dict[str, list[tuple[int, float]]], killed_at: float) -> float:
    """Seconds from the kill until every survivor had completed a global epoch."""
    return max(min(t for _, t in times if t > killed_at) for times in survivors.values()) - killed_at


def _leave(peer: PeerProcess) -> None:
    os.killpg(peer.pgid, signal.SIGTERM)
    assert peer.wait(timeout=30) == 0, peer.output()[-3000:]


def test_faulty_peer_never_shares_nonfinite_numbers_and_a_mismatched_newcomer_is_refused(peers, tmp_path):
    run = "pytest-faulty"
    _, address = _bootstrap(peers, run, tmp_path)
    # no fixed last epoch: the healthy peer trains alone at about 4 global epochs a second until the faulty
    # one is up, which took until epoch 11 in a fresh clone, and a fault at +6 then fell after --max-epochs 16
    common = ("--max-epochs", "100000", "--initial-peers", address)
    healthy = _join(peers, "healthy", run, tmp_path, *common, seed=1)
    faulty = _join(
        peers, "faulty", run, tmp_path, *common, "--inject-fault", "nan_grad@+3x3,nan_params@+6", seed=2
    )
    healthy.wait_for(r"\| epoch \d+ \| peers 2", timeout=180)

    # another model under the same run id: refused before it has an averager, the swarm never sees it
    wrong = _join(
        peers, "wrong", run, tmp_path, "--initial-peers", address, "--model", "vit_small_patch16_224", seed=3
    )
    assert wrong.wait(timeout=120) == 1, wrong.output()[-3000:]
    out = wrong.output()
    assert "do not match the swarm 'pytest-faulty'" in out, out[-3000:]
    assert "model.model_name: swarm vit_tiny_patch16_224, here vit_small_patch16_224" in out
    assert "--run-id" in out and "Traceback" not in out
    assert "Loaded the swarm's state" not in out and "To join this swarm" not in out

    # both train on until the faulty peer has rolled back its NaN parameters and 4 more global epochs passed
    rolled_back = faulty.wait_for(r"The parameters are non-finite after global epoch (\d+)", timeout=240)
    rolled = int(rolled_back.group(1))
    assert wait_until(lambda: min(healthy.epoch(), faulty.epoch()) >= rolled + 4, timeout=180), (
        faulty.output()[-3000:]
    )
    signalled_at = time.time()
    for p in (healthy, faulty):
        os.killpg(p.pgid, signal.SIGTERM)
    for p in (healthy, faulty):
        assert p.wait(timeout=120) == 0, f"{p.name}:\n{p.output()[-4000:]}"
    assert not any("| peers 3" in line for line in healthy.lines + faulty.lines), "the refused peer took part"

    good, bad = read_summary(tmp_path, run, "healthy"), read_summary(tmp_path, run, "faulty")
    # the faulty peer skipped its 3 bad steps and rolled back its bad parameters, and said so
    assert bad["skipped_nonfinite_steps"] == 3, bad
    assert bad["nonfinite_rollbacks"] == 1 and bad["resyncs"] >= 2, bad
    assert "Skipping a step with non-finite gradients" in faulty.output()
    assert "The parameters are non-finite after global epoch" in faulty.output()
    # nothing non-finite ever reached the healthy peer, and after the rollback both held the same parameters
    # (at one of their last two common epochs before the signal: a round in flight at SIGTERM may differ)
    assert good["skipped_nonfinite_steps"] == 0 and good["nonfinite_rollbacks"] == 0
    assert _finite(good["checksums"])
    common_epochs, equal = synced_epochs(good, bad, rel=1e-6, between=(0.0, signalled_at))
    after = [e for e in common_epochs if e > rolled]
    assert len(after) >= 2 and set(after[-2:]) & set(equal), (after, equal, bad["checksums"])


@pytest.mark.slow  # 70 s; tests/patches/test_state_averager.py shows the swarm's vote on a state in-process
def test_a_peer_whose_state_went_astray_takes_the_swarms_instead_of_rejecting_every_round(peers, tmp_path):
    """A peer whose parameters turn into random numbers of their own norms (a bug, a stale state) finds the
    next state round far from its parameters (the screen rejects it), asks the swarm's published sketches,
    finds that both other peers hold one other state, and downloads it: after that it holds the others'
    parameters, and nobody bans it. Without the vote (``--no-check-downloads``) it rejected 6 state rounds,
    ended at val acc 0.51 against the others' 0.85, and both others banned it."""
    run = "pytest-astray"
    _, address = _bootstrap(peers, run, tmp_path)
    # the three start training together: where the swarm makes 4-5 global epochs a second, c came up 13 epochs
    # behind the others and wandered while it still caught up, so it took their state as a peer behind does
    # (a download) before its astray check could run
    common = ("--max-epochs", "100000", "--initial-peers", address, "--min-peers", "3")
    honest = [_join(peers, name, run, tmp_path, *common, seed=seed) for name, seed in (("a", 1), ("b", 2))]
    astray = _join(peers, "c", run, tmp_path, *common, "--inject-fault", "wander@+6", seed=3)
    went = astray.wait_for(
        r"FAULT INJECTED: the parameters went astray after global epoch (\d+)", timeout=240
    )
    wandered = int(went.group(1))
    astray.wait_for(r"This peer's state is astray from the swarm's: 2 of the 2 other peers", timeout=120)
    assert wait_until(lambda: min(p.epoch() for p in (*honest, astray)) >= wandered + 8, timeout=180), (
        astray.output()[-3000:]
    )
    signalled_at = time.time()
    for p in (*honest, astray):
        os.killpg(p.pgid, signal.SIGTERM)
    for p in (*honest, astray):
        assert p.wait(timeout=120) == 0, f"{p.name}:\n{p.output()[-4000:]}"

    mine = read_summary(tmp_path, run, "c")
    assert mine["astray_resyncs"] == 1 and mine["resyncs"] == 1, mine
    assert "Rejected the state averaging round" in astray.output()
    assert "Resynchronising with the swarm after its state went astray" in astray.output()
    for p in (*honest, astray):
        assert "Banned peer" not in p.output(), p.output()[-3000:]
    # after the download, it held the same parameters as the others (at one of the last common epochs
    # before the signal: a round in flight at SIGTERM may differ)
    for other in honest:
        theirs = read_summary(tmp_path, run, other.name)
        common_epochs, equal = synced_epochs(theirs, mine, rel=1e-6, between=(0.0, signalled_at))
        after = [e for e in common_epochs if e > wandered + 2]
        assert len(after) >= 2 and set(after[-2:]) & set(equal), (other.name, after, equal)


VAL_IMAGES = 359  # the demo's validation split of the digits set


@pytest.mark.slow  # 50 s; tests/patches/test_allreduce.py shows items 8 and 11 on plain hivemind and patched
def test_a_groupmate_that_never_learnt_of_the_group_is_met_in_the_next_round(peers, tmp_path):
    """A follower gives up on its leader before the answer (``abandon:join``, as a starved process does),
    while the leader has taken it in (docs/hivemind-patches.md items 8 and 11). The leader drops it from the
    all-reduce within ``request_timeout``, skips that epoch's state round and meets it in the next gradient
    round, where the follower still waits. Before item 11 the two waited for each other in different
    averagers (the leader in its state round, the follower in gradient matchmaking) until the
    ``averaging_timeout``, here 30 s: no round may come near it. Afterwards both hold the same parameters."""
    run = "pytest-stranger"
    _, address = _bootstrap(peers, run, tmp_path)
    common = ("--max-epochs", "100000", "--initial-peers", address, "--averaging-timeout", "30")
    steady = _join(peers, "steady", run, tmp_path, *common, seed=1)
    steady.wait_for(r"\| epoch \d+ \|", timeout=180)
    starved = _join(peers, "starved", run, tmp_path, *common, "--inject-fault", "abandon:join@+2", seed=2)
    starved.wait_for("FAULT INJECTED: gave up on a join request", timeout=240)
    fired_at = time.time()
    # 6 epochs after the fault, counted from each peer's first progress line after it: the lines come every
    # log_every seconds and trail these 0.1-0.2 s epochs by several, so the last line before the fault could
    # leave only 2 epochs after it (a fresh-clone suite stopped the two at 175 = 169 + 6, the fault at 173)
    after = [p.wait_for(r"\| epoch (\d+) \|", timeout=120, after=fired_at) for p in (steady, starved)]
    later = max(int(m.group(1)) for m in after) + 6
    for p in (steady, starved):
        _wait_epoch(p, later, timeout=120)
    for p in (steady, starved):
        assert p.stop(grace=60) == 0, f"{p.name}:\n{p.output()[-4000:]}"

    leader, follower = read_summary(tmp_path, run, "steady"), read_summary(tmp_path, run, "starved")
    met = [r for r in leader["rounds"] if r["strangers"]]
    slowest = {s["peer_name"]: max(s["rounds"], key=lambda r: r["end"]) for s in (leader, follower)}
    print(f"\nrounds that met a stranger: {met}; each peer's slowest round: {slowest}")
    # The fault names the follower once. A follower starved for longer than request_timeout (1.5 s in the
    # demo config) does the same thing on its own on a busy machine: a fresh-clone suite saw a second such
    # round 7 epochs after the fault. Every one of them must skip its state round and be
    # followed by a round that the follower averaged with the leader, which is what item 11 promises.
    # The follower's next round is found by time, not by number: a follower that was two epochs behind
    # when it was named (a newcomer still catching up: 160 against the leader's 161) numbers the round in
    # which it meets the leader's 163 as its 162 (hivemind steps one epoch, and a state round lifts the
    # epoch at most one above its own, item 9), so there was no round 163 to look at (a fresh-clone suite)
    ended = {h["epoch"]: h["time"] for h in leader["history"]}
    follower_rounds = sorted(
        ((h["time"], h["round"]) for h in follower["history"] if h.get("round")), key=lambda x: x[0]
    )
    assert met, leader["rounds"]
    for r in met:
        later = [f for t, f in follower_rounds if t > ended[r["epoch"]]]
        if not later:
            continue  # named in the last round before the two were stopped: no next round to look at
        after = later[0]
        averaged_next = after.get("outcome") == "averaged" and after.get("group") == 2
        assert r["state"] == 0.0 and averaged_next, (r, after)
    epochs = [r["epoch"] for r in met]
    assert all(b - a > 1 for a, b in zip(epochs, epochs[1:], strict=False)), epochs  # not named twice running
    assert "meets them in the next gradient round" in steady.output()
    for name, r in slowest.items():  # a stall lasts the averaging_timeout (30 s); meeting again takes ~2 s
        assert r["end"] < 10.0, (name, r)
    common_epochs, equal = synced_epochs(leader, follower, rel=1e-6, between=(fired_at, time.time()))
    assert len(common_epochs) >= 3 and set(common_epochs[-3:]) & set(equal), (common_epochs, equal)


def _val_accs(peer: PeerProcess) -> list[tuple[int, float]]:
    """(global epoch, val acc) of each of the peer's validation lines so far."""
    found = (re.search(r"Validation at global epoch (\d+): .* acc ([\d.]+),", line) for line in peer.lines)
    return [(int(m.group(1)), float(m.group(2))) for m in found if m]


@pytest.mark.slow  # 60 s; tests/patches/test_optimizer.py shows the screen reject such a round in-process
def test_an_attacker_sending_outsized_gradients_cannot_poison_the_swarm(peers, tmp_path):
    """An invited peer (this project's own code, --inject-fault big_grad) sends gradients 10,000 times too
    large and pointing uphill from its second global epoch on. Without the screen such a peer took an honest
    one from val acc 0.66 to 0.11 in 6 global epochs (reject_factor 0; see README). Here the honest peer
    rejects the rounds the attacker takes part in (the averaged gradient, and the averaged state whose AdamW
    statistics blew up) and trains on: its val acc at validations 4 to 6 after the attack began (global
    epochs +10 to +18) is on average no lower than at the last two before it (within two standard errors of
    a 359-image accuracy), nothing wedged, `status` shows
    the rejections, and both leave cleanly when told to (SIGTERM). Means, because the val acc of 359 images
    moves by up to 0.07 from one validation to the next, and dips right after the attack while the honest
    peer's steps go from two peers' samples to its own (5 runs: 0.72 -> 0.65 at worst, then back above
    0.72 within 4 validations)."""
    run = "pytest-poison"
    _, address = _bootstrap(peers, run, tmp_path)
    common = ("--max-epochs", "100000", "--initial-peers", address, "--eval-every", "3")
    honest = _join(peers, "honest", run, tmp_path, *common, seed=1)
    honest.wait_for(r"\| epoch \d+ \|", timeout=180)
    attacker = _join(
        peers, "attacker", run, tmp_path, *common, "--inject-fault", "big_grad@+2x10000000", seed=2
    )
    fault = attacker.wait_for(r"FAULT INJECTED: gradients x-10000 .* from global epoch (\d+)", timeout=180)
    attack = int(fault.group(1))

    def attacked_long_enough() -> bool:
        for p in (honest, attacker):
            assert p.proc.poll() is None, f"{p.name} exited:\n{p.output()[-4000:]}"
        rejected = sum("Rejected the gradient averaging round" in line for line in honest.lines)
        return rejected >= 3 and len([e for e, _ in _val_accs(honest) if e > attack]) >= 6

    wait_until(attacked_long_enough, timeout=240, interval=0.5)
    assert attacked_long_enough(), honest.output()[-4000:]
    status = PeerProcess(
        "status",
        ["status", "--initial-peers", address, "--run-id", run, "--host-maddr", "/ip4/127.0.0.1/tcp/0"],
        peers,
    )
    assert status.wait(timeout=120) == 0, status.output()
    assert re.search(r"rejected:\s+\d+ averaged rounds refused", status.output()), status.output()
    for p in (honest, attacker):
        assert p.stop(grace=60) == 0, f"{p.name}:\n{p.output()[-4000:]}"

    good = read_summary(tmp_path, run, "honest")
    assert good["skipped_nonfinite_steps"] == 0 and good["nonfinite_rollbacks"] == 0, good
    assert good["rejected_gradient_rounds"] >= 3, good
    assert any("| peers 2" in line for line in honest.lines), "the attacker never took part"
    vals = _val_accs(honest)
    before = [acc for epoch, acc in vals if epoch <= attack][-2:]
    after = [acc for epoch, acc in vals if epoch > attack][3:6]
    print(
        f"\nhonest val acc {before} before the attack (global epoch {attack}), {after} after; rejected "
        f"{good['rejected_gradient_rounds']} gradient and {good['rejected_state_rounds']} state rounds, "
        f"{good['rejected_downloads']} downloads"
    )
    # "no lower" within the sampling error of a 359-image accuracy: at a plateau the means before and after
    # are equal up to noise (a fresh clone failed with 0.794 after against 0.7995 before, 0.3 standard errors;
    # a poisoned peer lands at 0.09 to 0.14, 30 standard errors below)
    mean_before = sum(before) / len(before)
    noise = 2 * math.sqrt(mean_before * (1 - mean_before) / VAL_IMAGES)
    assert len(after) == 3 and sum(after) / 3 >= mean_before - noise, (vals, noise)


def test_a_peer_with_no_good_state_left_stops_with_one_line(peers, tmp_path):
    """Every step non-finite from global epoch 1 on: the peer resynchronises, rolls back, then exits 1 with
    one line that says what happened and what to do (no traceback, no endless warnings)."""
    lone = _join(
        peers, "lone", "pytest-wedge", tmp_path, "--max-epochs", "50", "--inject-fault", "nan_grad@1x1000"
    )
    assert lone.wait(timeout=180) == 1, lone.output()[-4000:]
    out = lone.output()
    errors = [line for line in lone.lines if line.startswith("Error:")]
    assert errors == [line for line in lone.lines if "no good state is left" in line], out[-4000:]
    assert len(errors) == 1 and "30 training steps in a row gave non-finite gradients" in errors[0], out[
        -4000:
    ]
    assert "Traceback" not in out
    assert out.count("Skipping a step with non-finite gradients") == 5, out[-4000:]  # steps 1-3, 10, 30
    assert "rolled back to this peer's last good state" in out


@pytest.mark.parametrize("role", ["peer", "monitor", "bootstrap"])
def test_a_role_whose_dht_process_dies_leaves_with_one_line(peers, tmp_path, role):
    """The DHT process (hivemind's child of the role's process; it holds the p2p daemon) killed under a
    training peer, a monitor or a bootstrap peer, as the kernel's OOM killer would: the role leaves within
    seconds and exits 1 with one line that says what happened and what to do (a peer's summary written), and
    stops the p2p daemon that the dead process left behind. Without the watch, every DHT request, and the
    averaging round that needed one, waited forever for an answer: the peer hung, silent."""
    run = f"pytest-dht-death-{role}"
    if role == "peer":
        proc = _join(peers, "lone", run, tmp_path, "--max-epochs", "100000")
        _wait_epoch(proc, 3, timeout=180)
    elif role == "monitor":
        args = ["monitor", *_common(run, tmp_path), "--checkpoint-uri", str(tmp_path / "ck")]
        proc = PeerProcess("monitor", args, peers)
        proc.join_address(timeout=120)
    else:
        proc = PeerProcess("bootstrap", ["bootstrap", *_common(run, tmp_path)], peers)
        proc.join_address(timeout=120)
    (daemon,) = p2p_daemons(proc.proc.pid)
    dht = int(Path(f"/proc/{daemon}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
    os.kill(dht, signal.SIGKILL)
    assert proc.wait(timeout=60) == 1, proc.output()[-4000:]
    out = proc.output()
    errors = [line for line in proc.lines if line.startswith("Error:")]
    assert errors == [
        f"Error: this peer's DHT process (PID {dht}) exited (killed by SIGKILL), and without it the peer "
        "cannot reach the swarm; start the peer again to rejoin (the swarm keeps its state). Out of memory? "
        "See dmesg"
    ], out[-4000:]
    assert "The DHT process exited: leaving the swarm after the current step" in out
    assert "Traceback" not in out and "Leaving did not finish" not in out, out[-4000:]
    if role == "peer":
        assert read_summary(tmp_path, run, "lone")["complete"] is True
    elif role == "monitor":
        assert "Monitor stopped at global epoch" in out, out[-4000:]
    wait_until(lambda: not is_p2p_daemon(daemon), timeout=10)
    assert not is_p2p_daemon(daemon), "the dead DHT process's p2p daemon still runs"
    # and nothing else of it either: a monitor whose DHT died while its averager started left that averager
    # running, ownerless, until something killed it
    wait_until(lambda: not group_members(proc.pgid), timeout=10)
    assert not group_members(proc.pgid), [
        Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group_members(proc.pgid)
    ]


def _wait_epoch(peer: PeerProcess, epoch: int, timeout: float) -> None:
    def reached() -> bool:
        if peer.epoch() >= epoch:
            return True
        assert peer.proc.poll() is None, f"{peer.name} exited:\n{peer.output()[-4000:]}"
        return False

    wait_until(reached, timeout=timeout, interval=0.5)
    assert peer.epoch() >= epoch, (
        f"{peer.name} stuck at epoch {peer.epoch()} < {epoch}:\n{peer.output()[-4000:]}"
    )


def _same_state(a: dict, b: dict, between: tuple[float, float]) -> None:
    """Both survivors hold finite parameters and averaged together within ``between``: equal at one of the
    last three global epochs that both completed in that window (a failed round leaves them apart until the
    next parameter averaging succeeds; see synced_epochs)."""
    assert _finite(a["checksums"]) and _finite(b["checksums"]), (a["checksums"], b["checksums"])
    common, equal = synced_epochs(a, b, NEAR, between)
    print(f"\n{a['peer_name']} and {b['peer_name']} equal at {len(equal)} of {len(common)} common epochs")
    assert common and equal and equal[-1] >= common[-3 if len(common) >= 3 else 0], (
        common,
        equal,
        a["checksums"],
        b["checksums"],
    )
    for s in (a, b):  # no survivor ever went back to an older global epoch
        epochs = [h["epoch"] for h in s["history"]]
        assert epochs == sorted(epochs), (s["peer_name"], epochs)


@pytest.mark.slow
def test_a_peer_killed_mid_accumulation_in_matchmaking_or_in_allreduce(peers, tmp_path):
    run = "pytest-kills"
    monitor = PeerProcess(
        "monitor",
        [
            "monitor",
            *_common(run, tmp_path),
            "--evaluate-every",
            "1000",
            "--checkpoint-uri",
            str(tmp_path / "ck"),
        ],
        peers,
    )
    address = monitor.join_address(timeout=120)
    forever = ("--max-epochs", "100000", "--initial-peers", address)
    survivors = [_join(peers, name, run, tmp_path, *forever, seed=i) for i, name in ((1, "a"), (2, "b"))]
    survivors[0].wait_for(r"\| epoch \d+ \| peers 2", timeout=180)

    kills = {}
    for i, (moment, said) in enumerate(
        (("accumulating", "mid-accumulation"), ("matchmaking", "matchmaking"), ("allreduce", "all-reduce"))
    ):
        victim = _join(
            peers,
            f"victim-{moment}",
            run,
            tmp_path,
            *forever,
            "--inject-fault",
            f"kill:{moment}@+2",
            seed=10 + i,
        )
        line = victim.wait_for("FAULT INJECTED", timeout=240).string
        assert said in line, line
        kills[moment] = victim.line_time("FAULT INJECTED")
        assert victim.wait_gone() == -signal.SIGKILL
        epoch = max(p.epoch() for p in survivors)
        for p in survivors:  # the survivors go on: two more global epochs each
            _wait_epoch(p, epoch + 2, timeout=AVERAGING_TIMEOUT + 90)

    # the dead peers' metrics records expire (20 s in the demo config): wait until the DHT holds the two
    # survivors' records only, and for the monitor to count 2 peers after that
    reader = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[address],
        record_validators=metrics.make_validators(run)[0],
    )
    try:
        live = wait_until(lambda: len(metrics.fetch(reader, run)) == 2, timeout=60, interval=1.0)
        assert live, f"records still in the DHT: {[r.peer_name for r in metrics.fetch(reader, run).values()]}"
    finally:
        reader.shutdown()
    monitor.wait_for(r"global epoch \d+ \| peers 2 \|", timeout=60, after=time.time())
    epoch = max(p.epoch() for p in survivors)
    for p in survivors:
        _wait_epoch(p, epoch + 2, timeout=90)
    left_at = time.time()
    for p in survivors:
        _leave(p)
    _leave(monitor)

    a, b = (read_summary(tmp_path, run, name) for name in ("a", "b"))
    _same_state(a, b, (kills["allreduce"], left_at))
    times = {"a": _epoch_times(tmp_path, run, "a"), "b": _epoch_times(tmp_path, run, "b")}
    recovery = {moment: round(_recovery(times, at), 1) for moment, at in kills.items()}
    print(f"\nseconds from the kill until both survivors completed a global epoch: {recovery}")
    for moment, seconds in recovery.items():
        assert seconds < AVERAGING_TIMEOUT + 15, (moment, recovery)

    from swarm.training.logbook import read_run

    peer_counts = [int(v) for _, v in read_run(tmp_path / run / "monitor")[0]["swarm/peers"]]
    assert max(peer_counts) >= 3 and peer_counts[-1] == 2, peer_counts


@pytest.mark.slow  # 80 s; the default suite keeps the faulty-peer test, `make test-slow` runs this one
def test_the_entry_peer_dies_and_newcomers_join_through_any_survivor(peers, tmp_path):
    run = "pytest-entry"
    # the three first peers start training together: alone, the entry peer made 24-26 global epochs before
    # the others were up on a machine where the swarm makes 4-5 a second, and they refused its state as one
    # that no other peer could vouch for (an epoch ahead of every other peer's)
    forever = ("--max-epochs", "100000", "--min-peers", "3")
    entry = _join(peers, "entry", run, tmp_path, *forever, seed=1)
    address = entry.join_address(timeout=120)
    others = [
        _join(peers, n, run, tmp_path, *forever, "--initial-peers", address, seed=i)
        for i, n in ((2, "b"), (3, "c"))
    ]
    others[0].wait_for(r"\| epoch \d+ \| peers 3", timeout=180)
    # every peer printed its own join line, so any of them can take newcomers
    own = [p.join_address(timeout=10) for p in others]
    assert len({port_of(a) for a in [address, *own]}) == 3, (address, own)

    killed_epoch = max(p.epoch() for p in others)
    os.killpg(entry.pgid, signal.SIGKILL)  # the machine that started the swarm is gone, without a goodbye
    killed_at = time.time()
    entry.wait_gone()
    for p in others:
        _wait_epoch(p, killed_epoch + 3, timeout=AVERAGING_TIMEOUT + 90)

    newcomer = _join(peers, "d", run, tmp_path, *forever, "--initial-peers", own[1], seed=4)
    # two epochs past the one it loaded (its progress lines, once a second, may still show an earlier one)
    loaded_line = newcomer.wait_for(r"Loaded the swarm's state from peers: global epoch (\d+)", timeout=120)
    _wait_epoch(newcomer, int(loaded_line.group(1)) + 2, timeout=120)
    left_at = time.time()
    for p in [*others, newcomer]:
        _leave(p)

    b, c, d = (read_summary(tmp_path, run, n) for n in ("b", "c", "d"))
    _same_state(b, c, (killed_at, left_at))
    recovery = _recovery(
        {"b": _epoch_times(tmp_path, run, "b"), "c": _epoch_times(tmp_path, run, "c")}, killed_at
    )
    print(
        f"\nseconds from the entry peer's death until both survivors completed a global epoch: {recovery:.1f}"
    )
    assert recovery < AVERAGING_TIMEOUT + 15, recovery
    # the newcomer got the swarm's state (not its own initialisation) through a survivor's address
    loaded = d["loaded_epoch"]
    assert loaded is not None and loaded >= killed_epoch + 3, (loaded, killed_epoch)
    swarm_then = [
        s["checksums"][str(e)] for s in (b, c) for e in (loaded, loaded - 1) if str(e) in s["checksums"]
    ]
    assert any(_close(d["start_checksum"], x, NEAR) for x in swarm_then), (d["start_checksum"], swarm_then)
    assert d["final_epoch"] >= loaded + 2
