"""`swarm-peer bench`: what each way of training costs, measured on 127.0.0.1 with one thread per process.

Every scenario prints a table and appends one JSON object per measurement to ``--out`` (JSON lines), with
the date, the machine and the raw figures, so that a later run can be compared with this one.

* ``comm``: for each --compression mode and for DiLoCo, two real peers (``swarm-peer join``) train the demo
  model for the same number of samples. Bytes sent are the averagers' own counters (swarm/traffic.py), per
  averaging round (global epoch) and per training sample; validation accuracy is each peer's final one.
* ``join``: a newcomer downloads the state (parameters and AdamW moments) of ``vit_base_patch32_224`` from a
  peer in another process, against reading the same state from a local checkpoint (the limit).

Peers run as subprocesses of this command, in their own process groups, and are stopped when it ends.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.procs import remove_stale_sockets, start_group, stop_group

SCENARIOS = ("comm", "join")
COMM_MODES = ("none", "fp16", "int8", "powersgd:4", "diloco")
JOIN_RE = re.compile(r"swarm-peer join --initial-peers (\S+)")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.node()}: {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"


@dataclass
class Bench:
    out: Path
    work: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    def record(self, row: dict[str, Any]) -> None:
        row = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **row}
        self.rows.append(row)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


# ---- peers as subprocesses -----------------------------------------------------------------------------
class Peer:
    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = (log_dir / f"{name}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = start_group(
            [sys.executable, "-m", "peer", *args], stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        self.log_path = log_dir / f"{name}.log"

    def join_address(self, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = JOIN_RE.search(self.log_path.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} printed no join line; see {self.log_path}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        stop_group(self.proc, grace=15)
        self.log.close()


def _summary(log_dir: Path, run: str, name: str) -> dict[str, Any]:
    return json.loads((log_dir / run / "volunteer" / name / "summary.json").read_text())


# ---- comm --------------------------------------------------------------------------------------------
def comm(bench: Bench, samples: int, local_steps: int, batch: int = 32) -> None:
    """Two peers per mode, ``samples`` training samples in all (both peers together)."""
    began = time.time()
    for mode in COMM_MODES:
        diloco = mode == "diloco"
        # gradients: a global epoch every 128 samples (the demo's target); DiLoCo: 2 peers x H x batch
        target = 2 * local_steps * batch if diloco else 128
        epochs = max(2, samples // target)
        run = f"bench-comm-{mode.replace(':', '')}-{int(time.time())}"
        extra = (
            ["--averaging", "diloco", "--local-steps", str(local_steps)]
            if diloco
            else ["--compression", mode]
        )
        common = [
            "join", "--config", "demo", "--run-id", run, "--log-dir", str(bench.work), "--threads", "1",
            "--batch-size", str(batch), "--target-batch-size", str(target), "--max-epochs", str(epochs),
            "--eval-every", "100000", "--log-every", "10", *extra,
        ]  # fmt: skip
        started = time.time()
        first = Peer(f"{run}-a", [*common, "--peer-name", "a", "--seed", "1"], bench.work)
        peers = [first]
        try:
            address = first.join_address(timeout=120)
            peers.append(
                Peer(
                    f"{run}-b",
                    [*common, "--peer-name", "b", "--seed", "2", "--initial-peers", address],
                    bench.work,
                )
            )
            codes = [p.wait(timeout=1800) for p in peers]
        finally:
            for p in peers:
                p.stop()
        wall = time.time() - started
        if any(codes):
            raise RuntimeError(f"comm {mode}: a peer failed (exit codes {codes}); logs in {bench.work}")
        sums = [_summary(bench.work, run, n) for n in ("a", "b")]
        trained = sum(h["samples"] for s in sums for h in s["history"])
        sent = sum(s["bytes_sent"] for s in sums)
        rounds = max(s["final_epoch"] for s in sums) - min(s.get("loaded_epoch") or 0 for s in sums)
        accs = [s["final_val"]["acc"] for s in sums if s.get("final_val")]
        bench.record(
            {
                "scenario": "comm",
                "mode": mode,
                "local_steps": local_steps if diloco else None,
                "target_batch_size": target,
                "global_epochs": max(s["final_epoch"] for s in sums),
                "samples_trained": trained,
                "bytes_sent_both_peers": sent,
                "bytes_per_round_per_peer": sent / 2 / max(rounds, 1),
                "bytes_per_sample": sent / max(trained, 1),
                "val_acc": sum(accs) / len(accs) if accs else None,
                "val_acc_per_peer": accs,
                "wall_seconds": round(wall, 1),
            }
        )
        print(_comm_line(bench.rows[-1]), flush=True)
    remove_stale_sockets(since=began, exclude_own=True, settle=3.0)


def _comm_line(r: dict[str, Any]) -> str:
    acc = f"{r['val_acc']:.3f}" if r["val_acc"] is not None else "-"
    return (
        f"comm {r['mode']:>11}: {r['bytes_per_round_per_peer'] / 1e6:8.3f} MB/round/peer  "
        f"{r['bytes_per_sample']:10.1f} B/sample  val acc {acc}  ({r['global_epochs']} global epochs, "
        f"{r['samples_trained']} samples, {r['wall_seconds']:.0f} s)"
    )


def comm_table(rows: list[dict[str, Any]]) -> str:
    rows = [r for r in rows if r["scenario"] == "comm"]
    if not rows:
        return ""
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    lines = [
        "| mode | bytes / round / peer | bytes / sample | vs none | val acc | global epochs | samples |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = f"diloco H={r['local_steps']}" if r["mode"] == "diloco" else r["mode"]
        ratio = base["bytes_per_sample"] / max(r["bytes_per_sample"], 1e-9)
        acc = f"{r['val_acc']:.3f}" if r["val_acc"] is not None else "-"
        lines.append(
            f"| {name} | {r['bytes_per_round_per_peer']:,.0f} | {r['bytes_per_sample']:,.1f} | "
            f"{ratio:.1f}x fewer | {acc} | {r['global_epochs']} | {r['samples_trained']} |"
        )
    return "\n".join(lines)


# ---- join --------------------------------------------------------------------------------------------
def _flagship_state(model_name: str) -> tuple[Any, Any]:
    """The model and an AdamW with real (non-zero) moments after one step on random images."""
    import torch

    from swarm.config import build_config
    from swarm.model import SwarmClassifier

    cfg = build_config("flagship", {"model_name": model_name, "precision": "32-true"}, environ={})
    torch.manual_seed(0)
    module = SwarmClassifier(cfg.model, cfg.train)
    optimizer = module.configure_optimizers()["optimizer"]
    images = torch.randn(2, 3, cfg.model.img_size, cfg.model.img_size)
    torch.nn.functional.cross_entropy(module(images), torch.tensor([0, 1])).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return module, optimizer


def _state_averager(dht: Any, optimizer: Any, prefix: str, client_mode: bool) -> Any:
    from hivemind.optim.state_averager import TrainingStateAverager

    return TrainingStateAverager(
        dht=dht, optimizer=optimizer, prefix=prefix, client_mode=client_mode, start=True,
        request_timeout=10.0, min_matchmaking_time=2.0,
    )  # fmt: skip


def serve_state(model_name: str, prefix: str) -> None:
    """The donor of the join scenario (a separate process): shares its state until stdin closes."""
    import hivemind

    module, optimizer = _flagship_state(model_name)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = _state_averager(dht, optimizer, prefix, client_mode=False)
    averager.local_epoch = 1
    averager.state_sharing_priority = 1
    print("DONOR " + " ".join(str(a) for a in dht.get_visible_maddrs()), flush=True)
    try:
        sys.stdin.read()  # until the bench closes our stdin (or dies)
    finally:
        averager.shutdown()
        dht.shutdown()


def join(bench: Bench, model_name: str = "vit_base_patch32_224", repeats: int = 3) -> None:
    import hivemind
    import torch

    started = time.time()
    prefix = f"bench-join-{int(started)}_state_averager"
    donor = start_group(
        [sys.executable, "-m", "peer", "bench-donor", "--model", model_name, "--prefix", prefix],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    dht = averager = None
    try:
        line = donor.stdout.readline()
        if not line.startswith("DONOR "):
            raise RuntimeError(f"the donor did not start: {line!r}")
        module, optimizer = _flagship_state(model_name)  # same shapes; different values until loaded
        numbers = sum(p.numel() for p in module.parameters())
        state_bytes = 4 * numbers * 3  # float32 parameters and two AdamW moments
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=line.split()[1:])
        averager = _state_averager(dht, optimizer, prefix, client_mode=True)
        swarm_times = []
        for _ in range(repeats):
            averager.local_epoch = 0
            t0 = time.perf_counter()
            averager.load_state_from_peers(timeout=300)
            swarm_times.append(time.perf_counter() - t0)
            if averager.local_epoch != 1:
                raise RuntimeError("the newcomer did not receive the donor's state")
        with tempfile.TemporaryDirectory(dir=bench.work) as tmp:
            path = Path(tmp) / "state.pt"
            torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, path)
            disk_times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                loaded = torch.load(path, map_location="cpu", weights_only=True)
                module.load_state_dict(loaded["model"])
                optimizer.load_state_dict(loaded["optimizer"])
                disk_times.append(time.perf_counter() - t0)
            file_bytes = path.stat().st_size
    finally:
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()
        if donor.stdin:
            donor.stdin.close()
        stop_group(donor, grace=20)
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)
    bench.record(
        {
            "scenario": "join",
            "model": model_name,
            "parameters": numbers,
            "state_bytes": state_bytes,
            "checkpoint_file_bytes": file_bytes,
            "from_peer_seconds": [round(t, 2) for t in swarm_times],
            "from_checkpoint_seconds": [round(t, 2) for t in disk_times],
            "from_peer_MB_per_s": round(state_bytes / min(swarm_times) / 1e6, 1),
        }
    )
    print(
        f"join {model_name}: {numbers / 1e6:.1f} M parameters, {state_bytes / 1e9:.2f} GB of state; "
        f"from a peer {min(swarm_times):.1f} s (best of {repeats}), "
        f"from a local checkpoint {min(disk_times):.1f} s",
        flush=True,
    )


def join_table(rows: list[dict[str, Any]]) -> str:
    rows = [r for r in rows if r["scenario"] == "join"]
    lines = [
        "| model | state | from a peer (s) | from a local checkpoint (s) | peer MB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['state_bytes'] / 1e9:.2f} GB | "
            f"{', '.join(map(str, r['from_peer_seconds']))} | "
            f"{', '.join(map(str, r['from_checkpoint_seconds']))} | {r['from_peer_MB_per_s']} |"
        )
    return "\n".join(lines) if rows else ""


def run_bench(scenarios: list[str], out: Path, work: Path, samples: int, local_steps: int) -> Bench:
    bench = Bench(out=out, work=work)
    work.mkdir(parents=True, exist_ok=True)
    for name in scenarios:
        if name == "comm":
            comm(bench, samples=samples, local_steps=local_steps)
        elif name == "join":
            join(bench)
    print()
    for table in (comm_table(bench.rows), join_table(bench.rows)):
        if table:
            print(table + "\n")
    print(f"JSON lines appended to {out}")
    return bench
