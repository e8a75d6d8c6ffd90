"""Local cluster mode: real torch.distributed process groups (gloo on the CPU), started by real torchrun or
by Lightning from the CLI; results read back through summary.json, TensorBoard's reader, torch.load and timm.
"""

from __future__ import annotations

import json
import random
import socket
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from peer.cli import main
from peer.cluster import DistEnv, dist_env, make_plan
from swarm.config import ConfigError, build_config
from swarm.training.data import build_datasets, val_loader
from swarm.training.logbook import read_run
from swarm.training.model import evaluate
from swarm.training.tuning import largest_batch
from swarm.waiting import wait_until
from tests.helpers import PeerProcess, plain_timm_model

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# target 128: the batch arithmetic below (accumulation, global batch 120) was written for it
COMMON = [
    "--config",
    "demo",
    "--device",
    "cpu",
    "--threads",
    "1",
    "--log-every",
    "2",
    "--target-batch-size",
    "128",
]


@pytest.fixture
def loopback(monkeypatch):
    """Rendezvous and gloo traffic on 127.0.0.1 only."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def free_port() -> int:
    """A free port below the kernel's ephemeral range, so that no outgoing connection (gloo opens many)
    can take it between this check and torchrun binding it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(20000, min(low, 32768))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def run_dir(log_dir: Path, strategy: str) -> Path:
    return log_dir / "demo" / strategy


def read_tb(folder: Path) -> dict[str, list[tuple[int, float]]]:
    return read_run(folder)[0]  # TensorBoard's EventAccumulator, every event kept


def check_checkpoint_reproduces(folder: Path, board: dict) -> dict:
    """best.ckpt loads into a fresh timm model, which reproduces the val/acc logged for its epoch."""
    best = torch.load(folder / "checkpoints" / "best.ckpt")
    cfg = build_config("demo")
    net = plain_timm_model(cfg.model)
    net.load_state_dict(best["state_dict"])
    _, val_set = build_datasets(cfg.data, cfg.model.img_size)
    result = evaluate(net, val_loader(val_set, cfg.data), torch.device("cpu"))
    logged = dict(board["val/acc"])[best["global_epoch"]]
    assert abs(result["acc"] - logged) < 1e-6, (result, logged)
    assert abs(best["metrics"]["val/acc"] - max(v for _, v in board["val/acc"])) < 1e-6
    return best


def check_shards(summary: dict, n_train: int) -> None:
    """Each data epoch the ranks' shards are disjoint and of equal size; set_epoch reshuffles epoch 1."""
    ranks = summary["ranks"]
    world = len(ranks)
    for epoch in ("0", "1"):
        shards = [set(r["shards"][epoch]) for r in ranks]
        assert all(len(s) == n_train // world for s in shards), [len(s) for s in shards]
        assert len(set().union(*shards)) == world * (n_train // world), "shards overlap"
    first = ranks[0]["shards"]
    assert first["0"] != first["1"], "the sampler did not reshuffle for data epoch 1"


@pytest.mark.parametrize("launcher", ["torchrun", "cli"])
def test_two_rank_ddp_on_cpu(launcher, peers, loopback, tmp_path):
    log_dir = tmp_path / "runs"
    args = ["local", *COMMON, "--strategy", "ddp", "--max-epochs", "18", "--eval-every", "6"]
    args += ["--log-dir", str(log_dir)]
    if launcher == "torchrun":
        front = [*TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
        # 719 images per rank / 30 = 23 batches, an odd count for 2 accumulated: the last one must be skipped
        proc = PeerProcess("torchrun", [*args, "--batch-size", "30"], peers, launcher=front)
    else:  # Lightning starts the second process itself; the auto batch search is capped on the CPU
        proc = PeerProcess(
            "cli", [*args, "--devices", "2", "--batch-size", "auto", "--max-batch-size", "48"], peers
        )
    assert proc.wait(timeout=300) == 0, proc.output()[-5000:]
    folder = run_dir(log_dir, "ddp")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_epochs"] == 18, summary
    sums = [r["param_checksum"] for r in summary["ranks"]]
    assert sums[0] == sums[1], f"ranks hold different parameters after training: {sums}"
    # both ranks' own CPU time while they trained, summed (a rank may be the other's parent: counted once)
    own = [r["cpu_seconds"]["self"] for r in summary["ranks"]]
    assert min(own) > 0 and summary["cpu_seconds"]["self"] == pytest.approx(sum(own)), summary["cpu_seconds"]
    cfg = build_config("demo")
    train_set, _ = build_datasets(cfg.data, cfg.model.img_size)
    check_shards(summary, len(train_set))
    if launcher == "cli":
        assert summary["batch_size_found"] == 48 and summary["batch_size"] == 48, summary
        assert "Largest batch per device: 48" in proc.output()
        assert summary["global_batch"] == 48 * 2 * summary["accumulate"]
    else:
        assert summary["batch_size_found"] is None and summary["global_batch"] == 120
    # every optimizer step covered one whole global batch, also across data-epoch boundaries
    assert summary["samples"] == summary["global_epochs"] * summary["global_batch"], summary

    board = read_tb(folder)
    assert {"train/loss", "train/samples_per_second", "val/loss", "val/acc", "val/acc_top5"} <= set(board)
    for tag, points in board.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [s for s, _ in board["val/acc"]] == [6, 12, 18]
    assert len(board["train/loss"]) == 18
    assert "sys/gpu_mem_gb" not in board, "no GPU here: GPU figures must be absent, not zero"
    check_checkpoint_reproduces(folder, board)
    # rank 0 alone logs: one 'Validation at' line per evaluation, not one per rank
    assert proc.output().count("Validation at global epoch 6:") == 1, proc.output()[-3000:]


def test_fsdp_on_cpu_shards_and_saves_a_plain_checkpoint(peers, loopback, tmp_path):
    log_dir = tmp_path / "runs"
    front = [*TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    args = ["local", *COMMON, "--strategy", "fsdp", "--max-epochs", "8", "--eval-every", "4"]
    proc = PeerProcess("fsdp", [*args, "--log-dir", str(log_dir)], peers, launcher=front)
    assert proc.wait(timeout=300) == 0, proc.output()[-5000:]
    folder = run_dir(log_dir, "fsdp")
    summary = json.loads((folder / "summary.json").read_text())
    cfg = build_config("demo")
    total = sum(p.numel() for p in plain_timm_model(cfg.model).parameters())
    local = [r["local_parameters"] for r in summary["ranks"]]
    assert sum(local) == total and all(n < 0.6 * total for n in local), (local, total)
    board = read_tb(folder)
    losses = [v for _, v in board["train/loss"]]
    assert len(losses) == 8 and all(v == v and v < 10 for v in losses), losses
    best = check_checkpoint_reproduces(folder, board)
    assert best["optimizer"] is None  # FSDP's optimizer state stays sharded; weights are whole


# the FSDP variant (30 s more) runs in `make test-slow`
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_killed_rank_under_torchrun_resumes_from_the_snapshot(peers, loopback, tmp_path, strategy):
    """torchrun --max-restarts=1: rank 1 is SIGKILLed at global epoch 5 (a lost machine); torchrun restarts
    both ranks, which resume from the snapshot of epoch 4 (model, AdamW, scheduler, loops, the reporter's
    figures; FSDP's optimizer shards too) in the same run folder, and finish at epoch 8."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "runs"
    args = ["local", *COMMON, "--strategy", strategy, "--max-epochs", "8", "--eval-every", "4"]
    args += ["--snapshot-every", "2", "--inject-fault", "kill:rank@5", "--log-dir", str(log_dir)]
    front = [*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", "--master_addr=127.0.0.1"]
    proc = PeerProcess("torchrun", args, peers, launcher=[*front, f"--master_port={free_port()}"])
    assert proc.wait(timeout=300) == 0, proc.output()[-6000:]
    out = proc.output()
    assert "FAULT INJECTED: SIGKILL to rank 1 at global epoch 5" in out
    snapshot = run_dir(log_dir, strategy) / "snapshots" / "snapshot.ckpt"
    assert f"Resuming from {snapshot} (restart 1)" in out, out[-6000:]
    after = out[out.index("Resuming from") :]
    assert f"global epoch 5 | data epoch {5 * 128 / 1438:.2f}" in after  # the epoch after the snapshot's
    assert sorted(p.name for p in (log_dir / "demo").iterdir()) == [strategy]  # the same run folder
    summary = json.loads((run_dir(log_dir, strategy) / "summary.json").read_text())
    assert summary["global_epochs"] == 8 and summary["samples"] == 8 * 128, summary
    assert [epoch for _, epoch, _ in summary["val_curve"]] == [4, 8]  # epoch 4's from the snapshot
    sums = [r["param_checksum"] for r in summary["ranks"]]
    assert sums[0] == sums[1] or strategy == "fsdp", sums  # FSDP ranks sum their own shards
    # what TensorBoard shows (it drops the lost attempt's events after the snapshot): each epoch once
    board = EventAccumulator(str(run_dir(log_dir, strategy)), size_guidance={"scalars": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss")] == list(range(1, 9))
    payload = torch.load(snapshot, map_location="cpu", weights_only=False)
    assert payload["global_step"] == 8 and payload["optimizer_states"][0]["state"], list(payload)


def test_multinode_form_two_torchrun_agents(peers, loopback, tmp_path):
    """The multi-node command: two torchrun agents (two 'nodes' on 127.0.0.1), one process each. The run stops
    after 0.3 passes over the 1438 training images: 431 samples, so at the 4th global epoch of 128 (512)."""
    log_dir, port = tmp_path / "runs", free_port()
    args = ["local", *COMMON, "--strategy", "ddp", "--max-data-epochs", "0.3", "--eval-every", "2"]
    args += ["--log-dir", str(log_dir), "--num-nodes", "2"]
    agents = [
        PeerProcess(
            f"node{rank}",
            args,
            peers,
            launcher=[*TORCHRUN, "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1"]
            + ["--master_addr=127.0.0.1", f"--master_port={port}"],
        )
        for rank in (0, 1)
    ]
    wait_until(lambda: all(a.proc.poll() is not None for a in agents), timeout=240, interval=0.5)
    codes = [a.proc.poll() for a in agents]
    assert codes == [0, 0], f"exit codes {codes}\n\n" + "\n\n".join(
        f"{a.name}:\n{a.output()[-4000:]}" for a in agents
    )
    summary = json.loads((run_dir(log_dir, "ddp") / "summary.json").read_text())
    assert (summary["num_nodes"], summary["devices"], summary["world_size"]) == (2, 1, 2), summary
    assert summary["global_epochs"] == 4 and summary["data_epochs"] == round(512 / 1438, 2), summary
    board, _ = read_run(run_dir(log_dir, "ddp"))
    assert [s for s, _ in board["train/data_epoch"]] == [1, 2, 3, 4], board["train/data_epoch"]
    assert board["train/data_epoch"][-1][1] == pytest.approx(512 / 1438)
    sums = [r["param_checksum"] for r in summary["ranks"]]
    assert sums[0] == sums[1], sums
    assert "Validation at" not in agents[1].output(), "node 1 must not log"


def test_report_on_a_swarm_run_and_a_ddp_run(peers, loopback, tmp_path):
    from PIL import Image

    log_dir = tmp_path / "runs"
    demo = PeerProcess(
        "demo",
        # 30 epochs: a round now ends in about half a second, and with 5 the first peer up could finish alone
        ["demo", "--peers", "2", "--max-epochs", "30", "--log-dir", str(log_dir), "--run-id", "swarm"],
        peers,
    )
    assert demo.wait(timeout=400) == 0, demo.output()[-5000:]
    ddp = PeerProcess(
        "ddp",
        ["local", *COMMON, "--strategy", "ddp", "--devices", "2", "--max-epochs", "6", "--eval-every", "3"]
        + ["--log-dir", str(log_dir)],
        peers,
    )
    assert ddp.wait(timeout=300) == 0, ddp.output()[-5000:]
    checkpoint = log_dir / "demo" / "ddp" / "checkpoints" / "best.ckpt"
    tested = CliRunner().invoke(main, ["evaluate", str(checkpoint), "--threads", "1"])
    assert tested.exit_code == 0, tested.output
    test_acc = json.loads((log_dir / "demo" / "ddp" / "test" / "evaluation.json").read_text())["acc"]
    out = CliRunner().invoke(main, ["report", str(log_dir)])
    assert out.exit_code == 0, out.output
    table = (log_dir / "report.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"swarm/monitor", "demo/ddp"}, table
    swarm = [c.strip() for c in rows["swarm/monitor"].split("|")[1:-1]]
    ddp_row = [c.strip() for c in rows["demo/ddp"].split("|")[1:-1]]
    # the demo's target batch (configs/demo.yaml)
    assert swarm[1] == "swarm (hivemind)" and swarm[2] == "2" and swarm[3] == "256", swarm
    assert swarm[5] == "30", swarm
    assert swarm[4] == swarm[8] == swarm[11] == swarm[12] == "n/a", "missing figures must read n/a"
    assert 0 <= float(swarm[7]) <= 1 and float(swarm[9]) > 0 and float(swarm[10]) > 0, swarm
    # data epochs: the monitor writes the peers' count at each global epoch, 256 samples per epoch / 1438
    assert float(swarm[6]) == pytest.approx(int(swarm[5]) * 256 / 1438, abs=0.01), swarm
    summary = json.loads((log_dir / "demo" / "ddp" / "summary.json").read_text())
    assert ddp_row[1].startswith("ddp") and ddp_row[2] == "2" and ddp_row[5] == "6", ddp_row
    assert ddp_row[7] == f"{summary['best_val_acc']:.4f}" and ddp_row[11] == "n/a", ddp_row
    assert ddp_row[6] == f"{summary['data_epochs']:.2f}", ddp_row
    assert ddp_row[8] == f"{test_acc:.4f}", ddp_row  # `swarm-peer evaluate` of its best.ckpt
    with Image.open(log_dir / "report.png") as image:
        assert image.format == "PNG" and image.size[0] > 300


# -- fast checks, one process -------------------------------------------------------------------------
def test_largest_batch_search_finds_the_edge():
    fits_below = lambda limit: lambda b: b <= limit  # noqa: E731
    assert largest_batch(fits_below(37), 8, 1000)[0] == 37
    assert largest_batch(fits_below(5000), 8, 1000)[0] == 1000  # capped
    assert largest_batch(fits_below(3), 8, 1000)[0] == 3  # the start already fails
    assert largest_batch(fits_below(0), 8, 1000)[0] == 0
    found, trials = largest_batch(fits_below(100), 16, 4096)
    assert found == 100 and len(trials) <= 12, trials


def test_dist_env_reads_torchrun_and_lightning_variables():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    torchrun |= {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert dist_env(torchrun) == DistEnv(3, 1, 4, 2, 1, True)
    assert dist_env({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}).rank == 1
    assert dist_env({}) == DistEnv()


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"devices": 3}, DistEnv(0, 0, 2, 2, 0, True), "--nproc_per_node"),
        ({"num_nodes": 3}, DistEnv(0, 0, 4, 2, 0, True), "--nnodes"),
        ({"strategy": "dp", "devices": 2}, DistEnv(), "on the CPU rehearse with --strategy ddp"),
        ({"strategy": "ddp_spawn"}, DistEnv(0, 0, 2, 2, 0, True), "under torchrun use ddp or fsdp"),
        ({"max_epochs": "none"}, DistEnv(), "needs a stop"),
    ],
)
def test_cluster_mistakes_are_one_line_config_errors(flags, env, message):
    cfg = build_config("demo", {"device": "cpu", "max_epochs": 3} | flags)
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg, env)


def test_local_cli_rejects_bad_flags_in_one_line():
    runner = CliRunner()
    for args, expected in [
        (["--batch-size", "lots"], "neither a whole number nor 'auto'"),
        (["--strategy", "horovod"], "'horovod' is not one of"),
        (["--precision", "16-mixed", "--device", "cpu", "--max-epochs", "1"], "16-mixed"),
        (["--num-nodes", "2", "--strategy", "single", "--max-epochs", "1"], "num_nodes"),
        (["--resume-from", "/no/snapshot.ckpt", "--max-epochs", "1", "--device", "cpu"], "no snapshot"),
    ]:
        result = runner.invoke(main, ["local", "--config", "demo", *args])
        assert result.exit_code == 2 and expected in result.output, (args, result.output)
        assert "Traceback" not in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ddp_on_gpu_logs_gpu_figures(peers, tmp_path):
    log_dir = tmp_path / "runs"
    args = ["local", "--config", "demo", "--device", "cuda", "--devices", "1", "--strategy", "ddp"]
    args += ["--precision", "bf16-mixed", "--batch-size", "auto", "--max-epochs", "6", "--eval-every", "3"]
    proc = PeerProcess("gpu", [*args, "--log-dir", str(log_dir)], peers)
    assert proc.wait(timeout=300) == 0, proc.output()[-5000:]
    summary = json.loads((run_dir(log_dir, "ddp") / "summary.json").read_text())
    assert summary["peak_allocated_gb"] > 0 and summary["batch_size_found"] >= 32, summary
    board = read_tb(run_dir(log_dir, "ddp"))
    assert "sys/gpu_mem_gb" in board and "sys/gpu_util" in board
