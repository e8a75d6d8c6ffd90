"""The monitor's aggregation of peer records and its TensorBoard run, read back with TensorBoard's reader."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from monitor.aggregate import EpochAggregator, EpochPoint, aggregate
from monitor.board import EVAL_ACC, Board
from swarm.config import build_config
from swarm.net.metrics import LocalMetrics


def rec(name: str, epoch: int, **kw) -> LocalMetrics:
    values = dict(
        peer_name=name,
        global_epoch=epoch,
        samples_per_second=10.0,
        loss=2.0,
        samples_accumulated=100,
        mini_steps=4,
        time=0.0,
    )
    return LocalMetrics(**{**values, **kw})


def test_weighted_means_and_sums():
    val_a = dict(val_epoch=4, val_acc=0.5, val_loss=1.5, val_samples=100)
    val_b = dict(val_epoch=4, val_acc=0.9, val_loss=0.5, val_samples=300)
    records = [
        rec("a", 4, loss=1.0, samples_accumulated=300, samples_per_second=30.0, **val_a),
        rec("b", 4, loss=3.0, samples_accumulated=100, samples_per_second=12.5, **val_b),
        rec("c", 4, loss=9.0, samples_accumulated=0, mini_steps=0),  # contributed nothing: no weight
    ]
    point = aggregate(4, records, peers=3)
    assert point.samples_per_second == pytest.approx(52.5)
    assert point.loss == pytest.approx((1.0 * 300 + 3.0 * 100) / 400)
    assert point.val_acc == pytest.approx((0.5 * 100 + 0.9 * 300) / 400)
    assert point.val_loss == pytest.approx((1.5 * 100 + 0.5 * 300) / 400)
    stale = aggregate(5, [rec("a", 5, val_epoch=4, val_acc=0.5, val_samples=10)], peers=1)
    assert stale.val_acc is None, "validation of an older epoch is not logged at this epoch"


def test_clipped_parts_are_summed_and_suspects_counted_by_the_peers_that_ban_them():
    records = [
        rec("a", 4, round_clipped=3, banned=["12D3KooWattacker"]),
        rec("b", 4, round_clipped=2, banned=["12D3KooWattacker", "12D3KooWother"]),
        rec("c", 4),  # a peer of an older release, or one that clipped nothing and bans no one
    ]
    point = aggregate(4, records, peers=3)
    assert point.clipped == 5
    assert point.suspects == {"12D3KooWattacker": 2, "12D3KooWother": 1}


def test_epochs_are_released_once_in_order_and_peers_counted():
    agg = EpochAggregator(settle_time=3.0)
    a, b, c = b"a", b"b", b"c"
    assert agg.filed_epoch == -1
    agg.add({a: rec("a", 1), b: rec("b", 1)}, now=0.0)
    assert agg.ready(now=1.0) == []  # c has not reported: wait
    agg.add({a: rec("a", 1), b: rec("b", 1), c: rec("c", 1)}, now=1.5)
    assert agg.ready(now=2.0) == []  # everyone reported, but late records may still come
    points = agg.ready(now=3.5)
    assert [(p.epoch, p.peers) for p in points] == [(1, 3)]
    # b's epoch-2 record was overwritten by epoch 3 before we polled: b still counts at epoch 2
    agg.add({a: rec("a", 2), b: rec("b", 3), c: rec("c", 2)}, now=4.0)
    assert agg.filed_epoch == 2  # every live peer's records were read up to epoch 2 (the monitor's record)
    agg.add({a: rec("a", 3), b: rec("b", 3), c: rec("c", 3)}, now=5.0)
    agg.add({a: rec("a", 4), b: rec("b", 4), c: rec("c", 4)}, now=9.0)
    points = agg.ready(now=9.0)
    assert [(p.epoch, p.peers) for p in points] == [(2, 3), (3, 3)]
    assert agg.ready(now=20.0)[0].epoch == 4
    # c's record expired (it left): from now on it does not count
    agg.add({a: rec("a", 5), b: rec("b", 5)}, now=21.0)
    assert [(p.epoch, p.peers) for p in agg.ready(now=30.0)] == [(5, 2)]
    agg.add({a: rec("a", 5), b: rec("b", 5)}, now=31.0)
    assert agg.ready(now=40.0) == [], "an epoch is never released twice"


def test_a_validation_carried_by_later_records_lands_at_its_epoch_and_rounds_are_medians():
    """Peers re-send their latest validation until the next one: a monitor that missed the records of the
    validated epoch (epochs faster than its polls) still logs the validation at that epoch."""
    agg = EpochAggregator(settle_time=1.0)
    val = dict(val_epoch=5, val_acc=0.8, val_loss=0.7, val_samples=100)
    ends = dict(round_end=0.2, round_allreduce=0.05)
    agg.add(
        {
            b"a": rec("a", 6, **val, **ends),
            b"b": rec("b", 7, **val, round_end=0.4, round_local=True, round_rejected=True),
        },
        0.0,
    )
    agg.add({b"a": rec("a", 8, **val), b"b": rec("b", 8, **val)}, now=1.0)
    points = {p.epoch: p for p in agg.ready(now=5.0, closing=True)}
    assert sorted(points) == [5, 6, 7, 8]
    assert points[5].val_acc == pytest.approx(0.8) and points[5].train_records == 0
    assert points[6].val_acc is None and points[6].train_records == 1
    assert points[6].rounds == {"end": 0.2, "allreduce": 0.05} and points[6].local_steps == 0
    assert points[7].rounds["end"] == pytest.approx(0.4) and points[7].local_steps == 1
    assert (
        points[6].rejected == 0 and points[7].rejected == 1
    )  # b's screen refused a round (swarm/averaging/screen.py)


def test_closing_releases_finished_epochs_only():
    agg = EpochAggregator(settle_time=60.0)
    agg.add({b"a": rec("a", 7), b"b": rec("b", 6)}, now=0.0)
    assert [p.epoch for p in agg.ready(now=1.0, closing=True)] == [6]  # 7 is still incomplete


def test_the_last_epoch_is_written_after_every_peer_has_left():
    """Peers at max_epochs leave as soon as a monitor has read their records of the final epoch, and their
    records vanish with them: that epoch is still written once it settled, and at the latest when the
    monitor stops."""
    for closing in (False, True):
        agg = EpochAggregator(settle_time=3.0)
        agg.add({b"a": rec("a", 54), b"b": rec("b", 54)}, now=0.0)
        agg.add({b"a": rec("a", 55, final=True), b"b": rec("b", 55, final=True)}, now=1.0)
        assert [p.epoch for p in agg.ready(now=3.2)] == [54]  # 55 has not settled yet
        assert agg.filed_epoch == 55  # the monitor says so, and the peers leave
        agg.add({}, now=3.5)  # their records are gone
        points = agg.ready(now=3.6, closing=True) if closing else agg.ready(now=4.5)
        assert [(p.epoch, p.peers) for p in points] == [(55, 2)]


def test_board_appends_after_a_restart_without_repeating_steps(tmp_path):
    cfg = build_config("demo")
    board = Board(tmp_path)
    board.write_hparams(cfg)
    for epoch in (1, 2, 3):
        assert board.write_point(
            EpochPoint(epoch, 3, 30.0, 2.0 - epoch / 10, val_acc=0.1 * epoch, val_loss=1.0)
        )
    assert board.write_eval(3, {"acc": 0.3, "acc_top5": 0.8, "loss": 1.9})
    board.close()

    restarted = Board(tmp_path)
    assert restarted.last_step == 3 and restarted.last_eval_step == 3 and restarted.hparams_written
    restarted.write_hparams(cfg)  # a no-op the second time
    assert not restarted.write_point(EpochPoint(3, 3, 30.0, 1.0))
    assert not restarted.write_eval(3, {"acc": 0.9, "acc_top5": 0.9, "loss": 0.1})
    banned = {"12D3KooWattacker": 2}
    point = EpochPoint(
        4, 2, 20.0, 1.5, rounds={"end": 0.3}, local_steps=1, rejected=2, clipped=5, suspects=banned
    )
    assert restarted.write_point(point)
    restarted.close()

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    steps = [e.step for e in acc.Scalars("swarm/peers")]
    assert steps == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("swarm/peers")] == [3, 3, 3, 2]
    assert [e.step for e in acc.Scalars("val/acc")] == [1, 2, 3]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars(EVAL_ACC)] == [(3, 0.3)]
    assert [(e.step, e.value) for e in acc.Scalars("round/local_steps")] == [(4, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("round/rejected")] == [(4, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("round/clipped")] == [(4, 5.0)]
    assert [(e.step, e.value) for e in acc.Scalars("round/suspects")] == [(4, 1.0)]
    assert {"train/loss", "swarm/samples_per_second", "swarm/global_epoch", "val/loss"} <= set(
        acc.Tags()["scalars"]
    )
    assert list(acc.PluginTagToContent("hparams")), "hyperparameters are logged"
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_gpu_figures_and_data_epochs_reach_tensorboard_per_peer(tmp_path):
    """Peers on a GPU report NVML's memory and utilisation with each epoch; the monitor writes them per peer
    (sys/gpu_mem_gb/<peer>, sys/gpu_util/<peer>). A CPU peer reports none and gets no tag, never a 0."""
    records = [
        rec("gpu-a", 5, gpu_mem_gb=11.5, gpu_util=97.0, data_epoch=0.89),
        rec("gpu-b", 5, gpu_mem_gb=7.25, gpu_util=64.0, data_epoch=0.89),
        rec("cpu-c", 5, data_epoch=0.89),
    ]
    point = aggregate(5, records, peers=3)
    assert point.gpus == {"gpu-a": (11.5, 97.0), "gpu-b": (7.25, 64.0)} and point.data_epoch == 0.89
    board = Board(tmp_path)
    assert board.write_point(point)
    board.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {t for t in tags if t.startswith("sys/")} == {
        "sys/gpu_mem_gb/gpu-a",
        "sys/gpu_util/gpu-a",
        "sys/gpu_mem_gb/gpu-b",
        "sys/gpu_util/gpu-b",
    }
    assert [(e.step, e.value) for e in acc.Scalars("sys/gpu_mem_gb/gpu-b")] == [(5, 7.25)]
    assert [(e.step, e.value) for e in acc.Scalars("sys/gpu_util/gpu-a")] == [(5, 97.0)]
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/data_epoch")] == [(5, 0.89)]


def test_status_names_the_peers_that_peers_ban():
    from monitor.status import SwarmStatus, render

    records = [
        rec("a", 4, banned=["12D3KooWattacker"]),
        rec("b", 4, banned=["12D3KooWattacker"]),
        rec("c", 4),
    ]
    text = render(SwarmStatus("run", "addr", records=records, reachability="loopback only"))
    assert (
        "  suspect:        12D3KooWattacker is banned by 2 of 3 peers (its gradients or parameters were far "
        "from, against or unrelated to its groupmates' round after round)"
    ) in text.splitlines(), text


def test_status_says_which_epoch_the_monitor_holds():
    """The monitors' records (``<run>_monitor``): the newest epoch one evaluated and how old the newest record
    is; a monitor that evaluated nothing yet; none at all."""
    from monitor.status import SwarmStatus, render
    from swarm.net.metrics import MonitorRecord

    status = SwarmStatus("run", "addr", records=[rec("a", 40)], reachability="loopback only")
    line = [x for x in render(status, now=100.0).splitlines() if x.startswith("  monitor:")]
    assert line == [
        "  monitor:        none seen (`swarm-peer monitor` evaluates the swarm's model and keeps the best "
        "checkpoint)"
    ]
    status.monitors = [MonitorRecord(saved_epoch=35, time=93.0), MonitorRecord(saved_epoch=-1, time=99.0)]
    assert (
        "  monitor:        holds global epoch 35 (record renewed 1 s ago; 2 monitors)"
        in render(status, now=100.0).splitlines()
    )
    status.monitors = [MonitorRecord(saved_epoch=-1, time=90.0)]
    assert (
        "  monitor:        up, nothing evaluated yet (record renewed 10 s ago)"
        in render(status, now=100.0).splitlines()
    )


def test_the_monitor_names_each_banned_peer_once_with_what_to_do(caplog):
    """An open swarm: the advice is an invite-only swarm (an invite-only one names the invite and the revoke
    command, read from the member records: tests/test_invite.py)."""
    from monitor.role import _name_suspects

    cfg = build_config("demo")
    point = EpochPoint(41, 3, 30.0, 1.0, rounds={"end": 0.3}, suspects={"12D3KooWattacker": 2})
    named: set = set()
    with caplog.at_level("WARNING", logger="monitor.role"):
        _name_suspects(cfg, None, point, named, invite=None)
        _name_suspects(cfg, None, point, named, invite=None)  # once per peer
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        "Peer 12D3KooWattacker is banned by 2 of 3 peers at global epoch 41: its gradients or parameters "
        "were far from, against or unrelated to its groupmates' round after round (a peer that sends wrong "
        "numbers); this swarm is open to anyone"
    ), line


def test_status_leaves_a_claim_far_ahead_of_every_other_record_out_of_the_swarms_epoch():
    """A progress record may claim any epoch: one more than an epoch ahead of every other record (its own
    peer's metrics included) is shown apart, and the swarm's epoch, peers and next step come from the rest.
    An honest peer ahead of the others confirms its epoch with its own metrics record."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.p2p import PeerID

    from monitor.status import SwarmStatus, render

    ids = [
        PeerID.from_base58(text)
        for text in (
            "12D3KooWH6gn7k9ueUE7Lp32K8Cs7Ghbv3baEj5hLbWG5LYkiLJG",
            "12D3KooWJD72ZeDKvXAxpVZjzfip9yJBLKPA7hYpgMjz1ZWwhe3y",
            "12D3KooWB5DXRtFun4KsXvUVWK9rRMNGH8KZ8vqn87Evinh2vKjn",
        )
    ]

    def progress(peer, epoch, samples):
        return LocalTrainingProgress(
            peer_id=peer.to_bytes(), epoch=epoch, samples_accumulated=samples, samples_per_second=10.0,
            time=0.0, client_mode=False,
        )  # fmt: skip

    records = [rec("a", 40), rec("b", 40), rec("c", 40)]
    claimed = [progress(ids[0], 40, 64), progress(ids[1], 40, 32), progress(ids[2], 10**6 + 40, 0)]
    status = SwarmStatus("run", "addr", records=records, progress=claimed, reachability="loopback only")
    status.target_batch_size = 256
    lines = render(status).splitlines()
    assert "  global epoch:   40" in lines, lines
    assert "  next step:      96 / 256 samples (38%), next step in ~5.3 s" in lines, lines
    (line,) = [x for x in lines if x.startswith("  unconfirmed:")]
    assert f"peer {ids[2].to_base58()} claims global epoch 1000040" in line, line

    # a peer honestly ahead of the others publishes its metrics at that epoch: no claim
    ahead = [progress(ids[0], 40, 64), progress(ids[1], 40, 32), progress(ids[2], 45, 16)]
    status = SwarmStatus(
        "run", "addr", records=[*records[:2], rec("c", 45)], progress=ahead, reachability="loopback only"
    )
    lines = render(status).splitlines()
    assert "  global epoch:   45" in lines and not [x for x in lines if x.startswith("  unconfirmed:")], lines


def test_a_final_epoch_off_the_evaluation_rhythm_is_evaluated_once(tmp_path):
    """Peers at max_epochs mark their last record ``final`` and share their state until the monitor holds
    it: the monitor evaluates such an epoch at once, even off its ``evaluate_every`` rhythm, and only once
    per announced epoch, so that a record claiming a final epoch the swarm never reaches cannot make it
    download the state at every poll."""
    from monitor.role import Evaluator

    cfg = build_config("demo")  # evaluate_every 5
    board = Board(tmp_path)
    evaluator = Evaluator(cfg, model=None, board=board, keeper=None, loader=None)
    assert board.write_eval(5, {"acc": 0.5, "acc_top5": 0.9, "loss": 1.0})
    assert not evaluator.due(7)  # next evaluation at 10
    assert evaluator.due(7, {7})  # a peer's last epoch is 7: now
    assert board.write_eval(7, {"acc": 0.6, "acc_top5": 0.9, "loss": 0.9})
    assert not evaluator.due(7, {7})  # held already
    assert evaluator.due(8, {10**6})  # a claim far ahead: one evaluation ...
    assert board.write_eval(8, {"acc": 0.6, "acc_top5": 0.9, "loss": 0.9})
    assert not evaluator.due(8, {10**6}) and not evaluator.due(9, {10**6})  # ... not one per poll
    assert evaluator.due(9, {10**6, 9})  # and an honest last epoch beside it is still evaluated
    assert evaluator.due(10)  # the rhythm goes on
    board.close()
