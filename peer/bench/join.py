"""``join``: a newcomer downloads the state (parameters and AdamW moments) of ``vit_base_patch32_224`` from a
peer in another process, against reading the same state from a local checkpoint (the limit)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.bench.harness import Bench, Options, table
from swarm.procs import remove_stale_sockets, start_group, stop_group


def _flagship_state(model_name: str) -> tuple[Any, Any]:
    """The model and an AdamW with real (non-zero) moments after one step on random images."""
    import torch

    from swarm.config import build_config
    from swarm.training.model import SwarmClassifier

    cfg = build_config("flagship", {"model_name": model_name, "precision": "32-true"}, environ={})
    torch.manual_seed(0)
    module = SwarmClassifier(cfg.model, cfg.train, weights=False)
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


def run(bench: Bench, opts: Options, model_name: str = "vit_base_patch32_224", repeats: int = 3) -> None:
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


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = ["model", "state", "from a peer (s)", "from a local checkpoint (s)", "peer MB/s"]
    return table(
        rows,
        "join",
        header,
        lambda r: [
            r["model"],
            f"{r['state_bytes'] / 1e9:.2f} GB",
            ", ".join(map(str, r["from_peer_seconds"])),
            ", ".join(map(str, r["from_checkpoint_seconds"])),
            r["from_peer_MB_per_s"],
        ],  # fmt: skip
    )
