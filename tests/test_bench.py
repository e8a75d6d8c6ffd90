"""`swarm-peer bench` pieces that can be checked without a GPU: the FLOP count behind the step scenario's MFU,
the peak table, and the step scenario's clean skip on a machine without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from peer.bench.step import measure_step, peak_flops
from peer.cli import main


def _vit_b32_macs(
    tokens: int = 50, dim: int = 768, depth: int = 12, mlp: int = 3072, classes: int = 10
) -> int:
    """Multiply-adds of one ViT-B/32 forward at 224x224 (``depth`` blocks), counted by hand."""
    patches = tokens - 1
    embed = patches * dim * 3 * 32 * 32
    block = tokens * dim * 3 * dim + 2 * tokens * tokens * dim + tokens * dim * dim + 2 * tokens * dim * mlp
    return embed + depth * block + dim * classes


def test_step_flops_match_a_count_by_hand():
    r = measure_step("vit_base_patch32_224", batch=1, steps=1, warmup=0, device="cpu", depth=2)
    # backward costs twice the forward, except the patch embedding's input gradient (images need none)
    expected = 3 * 2 * _vit_b32_macs(depth=2) - 2 * 49 * 768 * 3 * 32 * 32
    assert r["flops_per_sample"] == pytest.approx(expected, rel=0.01), (r["flops_per_sample"], expected)
    assert r["samples_per_second"] > 0 and r["seconds"] > 0


def test_peaks_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("Some Other GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_step_scenario_skips_cleanly_without_a_gpu(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = CliRunner().invoke(
        main, ["bench", "--scenario", "step", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    )
    assert result.exit_code == 0, result.output
    assert "step: skipped, no CUDA GPU here" in result.output
    assert not out.exists() or not [json.loads(line) for line in out.read_text().splitlines()]


def test_every_scenario_is_a_module_with_run_and_table():
    from peer.bench import SCENARIOS, scenario

    for name in SCENARIOS:
        module = scenario(name)
        assert callable(module.run) and module.summary_table([]) == "", name
    with pytest.raises(ValueError, match="unknown bench scenario"):
        scenario("nope")
    result = CliRunner().invoke(main, ["bench", "--scenario", "nope"])
    assert result.exit_code == 2 and "'nope' is not one of" in result.output


def _wan_unavailable() -> str | None:
    from peer.bench.netns import unavailable

    return unavailable()


@pytest.mark.skipif(_wan_unavailable() is None, reason="checks the skip on a machine without root")
def test_wan_scenario_says_why_it_skips(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = CliRunner().invoke(
        main, ["bench", "--scenario", "wan", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    )
    assert result.exit_code == 0, result.output
    assert f"wan: skipped, {_wan_unavailable()}" in result.output
    assert not out.exists() or not out.read_text().strip()


def _send_through(lab, megabytes: float) -> float:
    """Seconds to send ``megabytes`` over TCP from the lab's namespace 1 to a server in namespace 0."""
    import subprocess
    import sys

    server = (
        "import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{lab.address(0)}', 5557)); s.listen(1); print('ready', flush=True)\n"
        "c,_=s.accept(); n=0\n"
        "while (d := c.recv(1 << 16)): n += len(d)\n"
        "print(n, flush=True)\n"
    )
    client = (
        "import socket,time\n"
        f"s=socket.create_connection(('{lab.address(0)}', 5557)); t=time.perf_counter()\n"
        f"s.sendall(b'x' * {int(megabytes * 1e6)}); s.shutdown(socket.SHUT_WR); s.recv(1); s.close()\n"
        "print(time.perf_counter() - t)\n"
    )
    srv = subprocess.Popen([*lab.prefix(0), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        sent = subprocess.run(
            [*lab.prefix(1), sys.executable, "-c", client],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert int(srv.stdout.readline()) == int(megabytes * 1e6)
        return float(sent.stdout)
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.slow  # a benchmark run (about a minute)
@pytest.mark.skipif(_wan_unavailable() is not None, reason=f"wan: {_wan_unavailable()}")
def test_wan_links_are_shaped_and_peers_train_across_them(tmp_path):
    from peer.bench import wan
    from peer.bench.harness import Bench, Options
    from peer.bench.netns import Lab

    with Lab(2, 20, tag=f"t{tmp_path.name[-4:]}") as lab:
        # 4 MB at 20 Mbit/s cannot take less than 1.6 s on any machine; on loopback it takes milliseconds
        assert _send_through(lab, 4.0) >= 1.55
    bench = Bench(out=tmp_path / "bench.jsonl", work=tmp_path / "w")
    bench.work.mkdir()
    # 16 rounds; the peers start together (--min-peers 2), and the first few run alone until their progress
    # trackers see each other (about a second)
    wan.run(bench, Options(wan_mbit=20), modes=("int8",), samples=4096)
    (row,) = bench.rows
    assert row["scenario"] == "wan" and row["mode"] == "int8" and row["mbit_per_second"] == 20
    assert row["global_epochs"] == 16, row
    # the peers reached each other across the shaped links: they averaged, or one downloaded the other's
    # state (without --min-peers, with 16 epochs of 0.3 s, a peer that came up 3 s after the other could find
    # it running alone and only ever catch up by downloads: loaded_epoch 3, 0 bytes averaged; and twice both
    # ran all 16 epochs alone, 2 s apart)
    assert row["bytes_sent_per_peer"] > 0 or max(row["loaded_epoch_per_peer"]) > 0, row
    (boot,) = bench.work.glob("bench-wan-int8-*-bootstrap.log")
    assert "--initial-peers /ip4/10.213.0.1/tcp/" in boot.read_text(), (
        "peers join through the lab's addresses"
    )
    assert not [line for line in _netns_list() if "swarmlab" in line], "the lab's namespaces were deleted"


def _netns_list() -> list[str]:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()


def test_scaling_repeats_are_summarised_by_their_median_and_range(tmp_path):
    """Each repeat's ratio is against its own DDP run; the summary row per mode is the median of those, with
    every repeat's figure kept, and the printed table shows the summaries only."""
    from peer.bench.harness import Bench
    from peer.bench.scaling import MEDIAN_FIELDS, _summarise, summary_table

    bench = Bench(out=tmp_path / "bench.jsonl", work=tmp_path)
    base = {"scenario": "scaling", "workers": 2, "batch_per_worker": 32, "target_batch_size": 2048}
    for repeat, (swarm_ratio, diloco_ratio) in enumerate([(0.99, 0.70), (0.78, 0.83), (0.76, 0.67)]):
        for mode, ratio in (("swarm", swarm_ratio), ("diloco", diloco_ratio)):
            figures = dict.fromkeys(MEDIAN_FIELDS, 1.0) | {"vs_ddp": ratio, "round_end_seconds_median": None}
            bench.record({**base, "mode": mode, "repeat": repeat, "local_steps": 50, **figures})
    _summarise(bench, list(bench.rows))
    medians = {r["mode"]: r for r in bench.rows if r["repeat"] == "median"}
    assert medians["swarm"]["vs_ddp"] == 0.78 and medians["swarm"]["vs_ddp_each"] == [0.99, 0.78, 0.76]
    assert (medians["diloco"]["vs_ddp_min"], medians["diloco"]["vs_ddp_max"]) == (0.67, 0.83)
    assert medians["swarm"]["round_end_seconds_median"] is None  # no round recorded: none, not a number
    written = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [r["repeat"] for r in written].count("median") == 2
    lines = summary_table(bench.rows).splitlines()
    assert len(lines) == 4 and "0.78 (0.99, 0.78, 0.76)" in lines[2], lines


def test_cpu_meter_counts_this_process_and_its_helper_processes():
    """CpuMeter (swarm/training/sysmetrics.py) splits the CPU time of a window between this process and its
    descendants: one that burnt CPU and exited (counted through its parent's reaped times), and one that
    burnt CPU and still runs (counted from /proc), as a peer's DHT process and averagers do."""
    import subprocess
    import sys
    import time

    from swarm.training.sysmetrics import CpuMeter

    def burn(seconds: float) -> str:
        return f"import time; t = time.process_time()\nwhile time.process_time() - t < {seconds}: pass\n"

    # each burn runs 0.05 s past the bound it is checked against: /proc counts CPU time in clock ticks
    # (10 ms here), truncated at both ends of the window (a burn of exactly 0.2 s once read 0.19 s)
    before = CpuMeter().start()
    meter = CpuMeter().start()
    subprocess.run([sys.executable, "-c", burn(0.35)], check=True, timeout=60)
    live = subprocess.Popen(
        [sys.executable, "-c", burn(0.35) + "print('burnt', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout.readline().strip() == "burnt"
        start = time.process_time()
        while time.process_time() - start < 0.25:  # this process's own share
            pass
        result = meter.stop()
    finally:
        live.kill()
        live.wait(timeout=30)
    assert result is not None and result == meter.result()
    assert 0.2 <= result["self"] < 0.6, result  # the burn, and not the helpers' time
    assert 0.6 <= result["helpers"] < 1.5, result  # two burns of 0.35 s, plus two interpreters' start-up
    assert result["wall"] >= 0.5, result
    assert meter.stop() == result  # a second stop keeps the first window
    assert before.stop()["helpers"] >= result["helpers"]  # the killed one's time reaches its reaper


def _volunteers_unavailable() -> str | None:
    from peer.bench import cpubudget, netns

    return netns.unavailable() or cpubudget.unavailable()


@pytest.mark.skipif(_volunteers_unavailable() is not None, reason=f"volunteers: {_volunteers_unavailable()}")
def test_a_volunteers_lab_delays_shapes_and_budgets_its_peers(tmp_path):
    """The volunteers lab's parts, in a few seconds: two peers 20 and 45 ms from the hub (one way) are at
    least 2 x 65 ms apart in round-trip time (the delay line never forwards early); 0.5 MB over a 2 Mbit/s
    upload takes at least 2 s; a busy loop in a budget of 0.2 of a core gets no more than that; and the
    namespaces, the delay line and the cgroups are gone afterwards."""
    import subprocess
    import sys
    import time

    from peer.bench.cpubudget import CpuBudgets
    from peer.bench.netns import Lab

    tag = f"s{tmp_path.name[-4:]}"
    with Lab(2, 2, tag=tag, up_mbit=[2, 2], down_mbit=[8, 8], delays_ms=[20, 45]) as lab:
        assert lab.address(0) == "10.214.0.2"
        rtt = lab.rtt_ms(0, 1)
        assert 130 <= rtt < 130 + 200, rtt
        assert _send_through(lab, 0.5) >= 1.95  # 4 Mbit at 2 Mbit/s, whatever the machine
        line = lab.line
    assert line is not None and line.poll() is not None, "the delay line stopped"
    with CpuBudgets([0.2], tag) as budgets:
        group = budgets.path(0)
        busy = "import os, time\nt = time.time()\nwhile time.time() - t < 2: pass\nprint(sum(os.times()[:2]))"
        started = time.monotonic()
        done = subprocess.run(
            [*budgets.prefix(0), sys.executable, "-c", busy], capture_output=True, text=True, check=True
        )
        wall = time.monotonic() - started
        # the kernel holds the group to 20 ms of CPU per 100 ms period (one period of slack)
        assert float(done.stdout) <= 0.2 * wall + 0.1, (done.stdout, wall)
    assert not group.exists(), "the cgroup was removed"
    assert not [name for name in _netns_list() if tag in name], "the lab's namespaces were deleted"


def test_churn_replaces_one_peer_in_five_every_30_to_60_s_and_counts_what_reached_an_epoch():
    """The volunteers lab's churn: the draws (every 30-60 s, 2 of 8 distinct slots) and the arithmetic of
    goodput (samples that reached a global epoch over what each incarnation's lone rate would have computed
    while it was alive, a newcomer's start-up included) and of a newcomer's time to its first averaged
    round."""
    from peer.bench.harness import Churn, Incarnation
    from peer.bench.volunteers import churn_fields

    churn, moments, t = Churn((30.0, 60.0), 0.2, seed=3), [], 0.0
    while t < 600:
        slots = churn.due(t, 8)
        if slots:
            moments.append(t)
            assert len(set(slots)) == 2 and all(1 <= s <= 8 for s in slots), slots
        t += 0.5
    gaps = [b - a for a, b in zip([0.0, *moments], moments, strict=False)]
    assert len(moments) >= 10 and all(30 <= g <= 60.5 for g in gaps), gaps

    def epoch(at: float, samples: int, averaged: bool = True) -> dict:
        return {"time": at, "samples": samples, "round": {"outcome": "averaged" if averaged else "local"}}

    churn.incarnations = [
        Incarnation(1, "p1", 990.0, killed=1050.0),  # what it computed after 1040 is lost with it
        Incarnation(2, "p2", 990.0),
        Incarnation(1, "p1-2", 1050.0),  # trains from 1070, first averaged round at 1080
    ]
    sums = [
        {"started_at": 1000.0, "history": [epoch(1010, 500), epoch(1040, 500)]},
        {"started_at": 1000.0, "history": [epoch(1010, 1000), epoch(1040, 2000), epoch(1100, 3000)]},
        {"started_at": 1070.0, "history": [epoch(1075, 100, False), epoch(1080, 400), epoch(1100, 500)]},
    ]
    for s, c in zip(sums, churn.incarnations, strict=True):
        s["incarnation"] = {"name": c.name}
    fields = churn_fields(sums, churn, [100.0, 200.0])
    # 8,000 samples; alive: 100/s x 50 s + 200/s x 100 s + 100/s x 50 s = 30,000
    assert fields["goodput"] == round(8000 / 30000, 3)
    assert fields["kills"] == 1 and fields["incarnations"] == 3
    assert fields["newcomer_seconds_each"] == [30.0] and fields["newcomer_startup_s"] == [20.0]
    assert fields["churn_window_s"] == 100.0 and fields["samples_per_second"] == 80.0


def test_an_attack_row_counts_each_honest_peers_bans_of_every_attacker():
    """With two attackers, a row reports when each honest peer had banned both (None if it banned one), from
    the suspects in its summary; a ban of an honest peer is not one of them."""
    from peer.bench.attack import ROWS, _banned_after, _bans, _peer_id

    began = 1000.0
    both = {"suspects": [{"peer": "A1", "first_banned": 1004.0}, {"peer": "A2", "first_banned": 1031.5},
                         {"peer": "H2", "first_banned": 0.0}]}  # fmt: skip
    one = {"suspects": [{"peer": "A1", "first_banned": 0.0}, {"peer": "A2", "first_banned": 1009.0},
                        {"peer": "H3", "first_banned": 1002.0}]}  # fmt: skip
    attackers = ["A1", "A2"]
    assert [_banned_after(s, began, attackers) for s in (both, one)] == [31.5, None]
    assert [len(_bans(s, attackers)) for s in (both, one)] == [2, 1]
    assert [_banned_after(s, began) for s in (both, one)] == [4.0, 2.0]  # any groupmate's first ban
    assert _peer_id("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWabc") == "12D3KooWabc"
    # the goal's window, with one attacker or two; the baselines train longer (honest peers start at once)
    assert {row.seconds for row in ROWS if row.fault} == {60.0}
    assert {row.seconds for row in ROWS if not row.fault} == {150.0}


def test_attack_rows_run_after_a_baseline_of_as_many_honest_peers_and_are_compared_after_as_long():
    """Each attack row is compared with a run without an attacker and as many honest peers, run first in the
    same call, at the same seconds of training; a baseline that did not train as long gives no figure."""
    from peer.bench.attack import ROWS, Timeline, run_order

    order = run_order(("honest norm",))
    assert [ROWS[n].attack for n, _ in order] == ["none", "none"] + ["random, honest norm"] * 2
    assert [row.honest for _, row in order] == [2, 3, 2, 3]
    assert [row.honest for _, row in run_order(("x -8",))][:2] == [2, 3]
    only_two = run_order(("x -4",))
    assert [(r.attack, r.honest) for _, r in only_two] == [("none", 2), ("x -4 (sign-flipped)", 2)]
    assert all(r.fault is None for _, r in run_order(("none",))) and len(run_order(("none",))) == 2
    assert len(run_order(())) == len(ROWS)  # every row once, baselines first
    assert [r.fault for _, r in run_order(())][:2] == [None, None]

    baseline = Timeline([(20.0, 3, 0.5), (41.5, 6, 0.8), (80.0, 12, 0.9)], trained_s=100.0)
    assert baseline.acc_at(41.5) == 0.8 and baseline.acc_at(79.9) == 0.8 and baseline.acc_at(95.0) == 0.9
    assert baseline.acc_at(10.0) is None  # no validation yet
    assert baseline.acc_at(100.1) is None  # it did not train that long
    assert (
        baseline.acc_at_epoch(6) == 0.8
        and baseline.acc_at_epoch(11) == 0.8
        and baseline.acc_at_epoch(12) == 0.9
    )
    assert (
        baseline.acc_at_epoch(2) is None and baseline.acc_at_epoch(13) is None
    )  # before its first, past its last
