"""`swarm-peer bench`: what each way of training costs, measured on 127.0.0.1 with one thread per process.

Every scenario prints a table and appends one JSON object per measurement to ``--out`` (JSON lines), with
the date, the machine and the raw figures, so that a later run can be compared with this one.

* ``comm``: for each --compression mode and for DiLoCo, two real peers (``swarm-peer join``) train the demo
  model for the same number of samples, with the state (parameters) averaged every 10th global epoch. Bytes
  sent are the averagers' own counters (swarm/traffic.py), per averaging round (global epoch) and per
  training sample, and apart for gradient and state rounds; validation accuracy is each peer's final one.
* ``scaling``: K swarm peers, K-rank DDP (gloo) and one process, with the demo model, the same per-worker
  batch and 16 per-step batches per global epoch; then K DiLoCo peers. Samples/s for each and the ratios.
* ``parity``: a 2-peer swarm with target batch B against one process with batch B, for the same samples.
* ``step`` (CUDA only): samples/s and model FLOPs utilisation of the ViT-B/32 training step, 224x224, bf16.
* ``join``: a newcomer downloads the state (parameters and AdamW moments) of ``vit_base_patch32_224`` from a
  peer in another process, against reading the same state from a local checkpoint (the limit).

Peers run as subprocesses of this command, in their own process groups, and are stopped when it ends.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.procs import remove_stale_sockets, start_group, stop_group

SCENARIOS = ("scaling", "comm", "join", "parity", "step")
COMM_MODES = ("none", "fp16", "int8", "powersgd:4", "diloco", "diloco+int8")
STATE_EVERY = 10  # comm: every mode averages the parameters (state) every 10th global epoch
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
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = (log_dir / f"{name}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
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


def _swarm(
    bench: Bench, run: str, peers: int, args: list[str], env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """A bootstrap peer and ``peers`` training peers (``swarm-peer join`` with ``args``, and config fields
    from ``env`` as SWARM_<FIELD> variables); their summaries.

    Starting through a bootstrap (a DHT node that does not train) means no trainer runs ahead alone while
    the others start."""
    common = ["--config", "demo", "--run-id", run, "--log-dir", str(bench.work)]
    boot = Peer(f"{run}-bootstrap", ["bootstrap", *common], bench.work)
    started = [boot]
    try:
        address = boot.join_address(timeout=120)
        for i in range(peers):
            name = f"p{i + 1}"
            started.append(
                Peer(
                    f"{run}-{name}",
                    [
                        "join",
                        *common,
                        "--initial-peers",
                        address,
                        "--peer-name",
                        name,
                        "--seed",
                        str(i + 1),
                        "--threads",
                        "1",
                        "--eval-every",
                        "100000",
                        "--log-every",
                        "10",
                        *args,
                    ],
                    bench.work,
                    env,
                )  # fmt: skip
            )
        codes = [p.wait(timeout=1800) for p in started[1:]]
    finally:
        for p in started:
            p.stop()
    if any(codes):
        raise RuntimeError(f"{run}: a peer failed (exit codes {codes}); logs in {bench.work}")
    return [_summary(bench.work, run, f"p{i + 1}") for i in range(peers)]


def _local(bench: Bench, run: str, strategy: str, devices: int, args: list[str]) -> dict[str, Any]:
    """``swarm-peer local`` (Lightning; gloo on the CPU) in its own process group; its summary."""
    log_dir = bench.work / "local"
    proc = Peer(
        f"{run}-{strategy}",
        ["local", "--config", "demo", "--run-id", run, "--log-dir", str(log_dir), "--strategy", strategy,
         "--devices", str(devices), "--device", "cpu", "--threads", "1", "--eval-every", "100000", *args],
        bench.work,
    )  # fmt: skip
    code = proc.wait(timeout=1800)
    if code:
        raise RuntimeError(f"local {strategy}: exit code {code}; see {proc.log_path}")
    found = sorted((log_dir / run).glob(f"{strategy}*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())


def _peer_rate(s: dict[str, Any]) -> float:
    """A peer's samples/s over its training windows (validation excluded, averaging waits included)."""
    done = [h for h in s["history"] if h["mini_steps"] and h["samples_per_second"]]
    return sum(h["samples"] for h in done) / max(s["train_seconds"], 1e-9)  # the summary's sum of windows


def _rounds(s: dict[str, Any]) -> int:
    return max(s["final_epoch"] - (s.get("loaded_epoch") or 0), 1)


def _table(rows: list[dict[str, Any]], scenario: str, header: list[str], cells: Any) -> str:
    """A markdown table of the rows of ``scenario`` ("" if none): ``cells(row)`` gives one line's cells."""
    rows = [r for r in rows if r["scenario"] == scenario]
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)


# ---- scaling -----------------------------------------------------------------------------------------
def scaling(bench: Bench, peers: int, local_steps: int, batch: int = 32, per_round: int = 16) -> None:
    """K peers vs K-rank DDP vs one process: the demo model, ``batch`` per worker, ``per_round`` per-step
    batches per global epoch (so that each worker computes per_round / K steps between two averagings)."""
    target = per_round * batch
    rounds = 12
    stamp = int(time.time())
    shared = ["--batch-size", str(batch), "--target-batch-size", str(target), "--max-epochs", str(rounds)]
    single = _local(bench, f"bench-scaling-{stamp}", "single", 1, shared)
    ddp = _local(bench, f"bench-scaling-{stamp}", "ddp", peers, shared)
    swarm = _swarm(bench, f"bench-scaling-swarm-{stamp}", peers, shared)
    # the same, with the parameters averaged every 10th global epoch instead of every one (the demo's)
    sparse = _swarm(
        bench, f"bench-scaling-swarm10-{stamp}", peers, shared, {"SWARM_AVERAGE_STATE_EVERY": "10"}
    )
    diloco_target = peers * local_steps * batch
    diloco_rounds = 3
    diloco = _swarm(
        bench,
        f"bench-scaling-diloco-{stamp}",
        peers,
        ["--batch-size", str(batch), "--target-batch-size", str(diloco_target), "--max-epochs",
         str(diloco_rounds), "--averaging", "diloco", "--local-steps", str(local_steps)],
    )  # fmt: skip
    single_sps, ddp_sps = single["samples_per_second"], ddp["samples_per_second"]
    runs = (("swarm", swarm, target), ("swarm-state10", sparse, target), ("diloco", diloco, diloco_target))
    for name, sums, tgt in runs:
        sps = sum(_peer_rate(s) for s in sums)
        rounds_done = max(_rounds(s) for s in sums)
        train = sum(s["train_seconds"] for s in sums) / len(sums)
        ends = sum(s["round_end_seconds"] for s in sums) / len(sums)
        bench.record(
            {
                "scenario": "scaling",
                "mode": name,
                "workers": peers,
                "batch_per_worker": batch,
                "target_batch_size": tgt,
                "local_steps": local_steps if name == "diloco" else None,
                "global_epochs": rounds_done,
                "samples_per_second": round(sps, 1),
                "samples_per_second_per_peer": [round(_peer_rate(s), 1) for s in sums],
                "ddp_samples_per_second": round(ddp_sps, 1),
                "single_samples_per_second": round(single_sps, 1),
                "vs_ddp": round(sps / ddp_sps, 3),
                "vs_k_single": round(sps / (peers * single_sps), 3),
                "ddp_vs_k_single": round(ddp_sps / (peers * single_sps), 3),
                # per global epoch and peer: the steps that ended a round (waiting for the swarm, matchmaking,
                # all-reduce, update) against all the rest (forward, backward, local optimizer steps)
                "seconds_per_round": round(train / rounds_done, 3),
                "round_end_seconds_per_round": round(ends / rounds_done, 3),
                "single_seconds_per_round": round(tgt / single_sps, 3),
                "average_state_every": 10 if name == "swarm-state10" else 1,
                "diloco_waiting_seconds_per_round": round(
                    sum(s.get("seconds_waiting_for_the_swarm", 0.0) for s in sums) / len(sums) / rounds_done,
                    3,
                )
                if name == "diloco"
                else None,
            }
        )
        print(_scaling_line(bench.rows[-1]), flush=True)


def _scaling_line(r: dict[str, Any]) -> str:
    return (
        f"scaling {r['mode']:>13} x{r['workers']}: {r['samples_per_second']:.1f} samples/s; DDP "
        f"{r['ddp_samples_per_second']:.1f}, one process {r['single_samples_per_second']:.1f}; "
        f"vs DDP {r['vs_ddp']:.2f}x, vs {r['workers']} x single {r['vs_k_single']:.2f}x; per round "
        f"{r['seconds_per_round']:.2f} s of which {r['round_end_seconds_per_round']:.2f} s ending it"
    )


def scaling_table(rows: list[dict[str, Any]]) -> str:
    names = {"swarm-state10": "swarm, parameters averaged every 10th epoch"}
    header = [
        "mode",
        "workers",
        "target batch",
        "samples/s",
        "DDP samples/s",
        "one process samples/s",
        "vs DDP",
        "vs K x one",
        "s per round",
        "of which ending the round",
    ]
    return _table(
        rows,
        "scaling",
        header,
        lambda r: [
            f"diloco H={r['local_steps']}" if r["mode"] == "diloco" else names.get(r["mode"], r["mode"]),
            r["workers"],
            r["target_batch_size"],
            r["samples_per_second"],
            r["ddp_samples_per_second"],
            r["single_samples_per_second"],
            f"{r['vs_ddp']:.2f}",
            f"{r['vs_k_single']:.2f}",
            f"{r['seconds_per_round']:.2f}",
            f"{r['round_end_seconds_per_round']:.2f}",
        ],  # fmt: skip
    )


# ---- parity ------------------------------------------------------------------------------------------
def parity(bench: Bench, samples: int, target: int = 128, batch: int = 32) -> None:
    """Two peers with target batch B (``batch`` per step each) against one process with batch B, for the
    same number of samples; validation accuracy of the final parameters on the whole validation set."""
    epochs = max(2, samples // target)
    stamp = int(time.time())
    shared = ["--target-batch-size", str(target), "--max-epochs", str(epochs)]
    swarm = _swarm(bench, f"bench-parity-swarm-{stamp}", 2, ["--batch-size", str(batch), *shared])
    single = _local(bench, f"bench-parity-{stamp}", "single", 1, ["--batch-size", str(target), *shared])
    accs = [s["final_val"]["acc"] for s in swarm if s.get("final_val")]
    curve = single.get("val_curve") or []
    single_acc = curve[-1][2] if curve else None
    bench.record(
        {
            "scenario": "parity",
            "target_batch_size": target,
            "swarm_batch_per_step": batch,
            "global_epochs": epochs,
            "samples": epochs * target,
            "swarm_val_acc": sum(accs) / len(accs) if accs else None,
            "swarm_val_acc_per_peer": accs,
            "swarm_final_epochs": [s["final_epoch"] for s in swarm],
            "single_val_acc": single_acc,
            "single_global_epochs": single.get("global_epochs"),
        }
    )
    r = bench.rows[-1]
    print(
        f"parity: {r['samples']} samples in {epochs} global epochs of {target}; 2-peer swarm val acc "
        f"{_fmt(r['swarm_val_acc'])}, one process (batch {target}) {_fmt(single_acc)}",
        flush=True,
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def parity_table(rows: list[dict[str, Any]]) -> str:
    def diff(r: dict[str, Any]) -> str:
        if r["swarm_val_acc"] is None or r["single_val_acc"] is None:
            return "-"
        return f"{100 * (r['swarm_val_acc'] - r['single_val_acc']):+.1f} points"

    header = [
        "target batch B",
        "samples",
        "2-peer swarm val acc",
        "one process (batch B) val acc",
        "difference",
    ]
    return _table(
        rows,
        "parity",
        header,
        lambda r: [
            r["target_batch_size"],
            r["samples"],
            _fmt(r["swarm_val_acc"]),
            _fmt(r["single_val_acc"]),
            diff(r),
        ],
    )


# ---- step -------------------------------------------------------------------------------------------
# dense bf16 tensor-core peaks (FLOP/s), by a word in torch.cuda.get_device_name(); --peak-tflops overrides
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12))


def peak_flops(device_name: str) -> float | None:
    return next((peak for word, peak in PEAK_BF16 if word in device_name), None)


def measure_step(
    model_name: str,
    batch: int,
    steps: int,
    warmup: int,
    device: str,
    img_size: int = 224,
    **model_kwargs: Any,
) -> dict[str, Any]:
    """Train ``model_name`` on CIFAR-sized uint8 images kept on ``device`` and resized there (bilinear) to
    ``img_size``, in bf16 autocast with AdamW: samples/s over ``steps`` after ``warmup``, and the FLOPs of one
    step as torch's FLOP counter counts them (forward and backward; the optimizer's are not counted)."""
    import timm
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=10, img_size=img_size, **model_kwargs).to(device)
    cuda = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    images = torch.randint(0, 256, (max(batch * 4, 1024), 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (images.shape[0],), device=device)
    mean = torch.tensor([0.4914, 0.4822, 0.4465], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616], device=device).view(1, 3, 1, 1)

    def forward_backward(i: int) -> None:
        idx = torch.randint(0, images.shape[0], (batch,), device=device)
        x = (images[idx].float() / 255 - mean) / std
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), labels[idx])
        loss.backward()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with FlopCounterMode(display=False) as counter:
        forward_backward(0)
    flops_per_step = counter.get_total_flops()
    optimizer.zero_grad(set_to_none=True)
    for i in range(warmup):
        forward_backward(i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for i in range(steps):
        forward_backward(i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - began
    return {
        "model": model_name,
        "img_size": img_size,
        "batch": batch,
        "steps": steps,
        "seconds": round(seconds, 3),
        "samples_per_second": round(batch * steps / seconds, 1),
        "flops_per_sample": flops_per_step / batch,
        "achieved_tflops": round(flops_per_step * steps / seconds / 1e12, 2),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def step(bench: Bench, batch: int, peak_tflops: float | None, steps: int = 50, warmup: int = 10) -> None:
    import torch

    if not torch.cuda.is_available():
        print("step: skipped, no CUDA GPU here (it measures the bf16 ViT-B/32 step on a GPU)", flush=True)
        return
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(name)
    r = measure_step("vit_base_patch32_224", batch, steps, warmup, "cuda")
    mfu = r["achieved_tflops"] * 1e12 / peak if peak else None
    bench.record(
        {
            "scenario": "step",
            "gpu": name,
            "precision": "bf16-mixed",
            **r,
            "peak_tflops": peak / 1e12 if peak else None,
            "mfu": round(mfu, 3) if mfu else None,
        }
    )
    print(
        f"step {r['model']} bf16 at {r['img_size']}px, batch {batch} on {name}: "
        f"{r['samples_per_second']:.0f} samples/s, {r['achieved_tflops']:.0f} TFLOP/s, MFU {_fmt(mfu)}"
        + ("" if peak else " (unknown peak: give --peak-tflops)"),
        flush=True,
    )


def step_table(rows: list[dict[str, Any]]) -> str:
    header = ["GPU", "model", "batch", "samples/s", "TFLOP/s", "MFU", "peak memory"]
    return _table(
        rows,
        "step",
        header,
        lambda r: [
            r["gpu"],
            f"{r['model']} {r['img_size']}px bf16",
            r["batch"],
            r["samples_per_second"],
            r["achieved_tflops"],
            _fmt(r["mfu"]),
            f"{r['peak_memory_gb']} GB",
        ],  # fmt: skip
    )


# ---- comm --------------------------------------------------------------------------------------------
def comm(bench: Bench, samples: int, local_steps: int, batch: int = 32) -> None:
    """Two peers per mode, ``samples`` training samples in all (both peers together)."""
    for mode in COMM_MODES:
        diloco = mode.startswith("diloco")
        # gradients: a global epoch every 128 samples (the demo's target); DiLoCo: 2 peers x H x batch
        target = 2 * local_steps * batch if diloco else 128
        epochs = max(2, samples // target)
        run = f"bench-comm-{mode.replace(':', '').replace('+', '-')}-{int(time.time())}"
        extra = (
            ["--averaging", "diloco", "--local-steps", str(local_steps)]
            if diloco
            else ["--compression", mode]
        )
        if mode == "diloco+int8":  # 8-bit pseudo-gradients, as in INTELLECT-1
            extra += ["--compression", "int8"]
        extra += ["--average-state-every", str(STATE_EVERY)]
        started = time.time()
        sums = _swarm(
            bench,
            run,
            2,
            [
                "--batch-size",
                str(batch),
                "--target-batch-size",
                str(target),
                "--max-epochs",
                str(epochs),
                *extra,
            ],
        )
        wall = time.time() - started
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
                "gradient_bytes_per_round_per_peer": sum(s["bytes_sent_gradients"] for s in sums)
                / 2
                / max(rounds, 1),
                "state_bytes_per_state_round_per_peer": sum(s["bytes_sent_state"] for s in sums)
                / 2
                / max(rounds // STATE_EVERY, 1),
                "average_state_every": STATE_EVERY,
                "val_acc": sum(accs) / len(accs) if accs else None,
                "val_acc_per_peer": accs,
                "wall_seconds": round(wall, 1),
            }
        )
        print(_comm_line(bench.rows[-1]), flush=True)


def _comm_line(r: dict[str, Any]) -> str:
    acc = f"{r['val_acc']:.3f}" if r["val_acc"] is not None else "-"
    return (
        f"comm {r['mode']:>11}: {r['bytes_per_round_per_peer'] / 1e6:8.3f} MB/round/peer  "
        f"{r['bytes_per_sample']:10.1f} B/sample  val acc {acc}  ({r['global_epochs']} global epochs, "
        f"{r['samples_trained']} samples, {r['wall_seconds']:.0f} s)"
    )


def comm_table(rows: list[dict[str, Any]]) -> str:
    comm_rows = [r for r in rows if r["scenario"] == "comm"]
    base = next((r for r in comm_rows if r["mode"] == "none"), comm_rows[0]) if comm_rows else None
    header = [
        "mode",
        "bytes / round / peer",
        "of which gradients",
        "bytes / state round / peer",
        "bytes / sample",
        "vs none",
        "val acc",
        "global epochs",
        "samples",
    ]
    return _table(
        rows,
        "comm",
        header,
        lambda r: [
            r["mode"].replace("diloco", f"diloco H={r['local_steps']}"),
            f"{r['bytes_per_round_per_peer']:,.0f}",
            f"{r['gradient_bytes_per_round_per_peer']:,.0f}",
            f"{r['state_bytes_per_state_round_per_peer']:,.0f}",
            f"{r['bytes_per_sample']:,.1f}",
            f"{base['bytes_per_sample'] / max(r['bytes_per_sample'], 1e-9):.1f}x fewer",
            "-" if r["val_acc"] is None else f"{r['val_acc']:.3f}",
            r["global_epochs"],
            r["samples_trained"],
        ],  # fmt: skip
    )


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
    header = ["model", "state", "from a peer (s)", "from a local checkpoint (s)", "peer MB/s"]
    return _table(
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


def run_bench(
    scenarios: list[str],
    out: Path,
    work: Path,
    samples: int,
    local_steps: int,
    peers: int = 2,
    step_batch: int = 256,
    peak_tflops: float | None = None,
) -> Bench:
    bench = Bench(out=out, work=work)
    work.mkdir(parents=True, exist_ok=True)
    began = time.time()

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so that every scenario stops the peers it started (finally blocks)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        for name in scenarios:
            t0 = time.time()
            if name == "scaling":
                scaling(bench, peers=peers, local_steps=local_steps)
            elif name == "comm":
                comm(bench, samples=samples, local_steps=local_steps)
            elif name == "join":
                join(bench)
            elif name == "parity":
                parity(bench, samples=samples)
            elif name == "step":
                step(bench, batch=step_batch, peak_tflops=peak_tflops)
            print(f"({name}: {time.time() - t0:.0f} s)", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        remove_stale_sockets(since=began, exclude_own=True, settle=3.0)
    print()
    tables = (scaling_table, comm_table, join_table, parity_table, step_table)
    for table in (t(bench.rows) for t in tables):
        if table:
            print(table + "\n")
    print(f"JSON lines appended to {out}")
    return bench
