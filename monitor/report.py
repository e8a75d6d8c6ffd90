"""`swarm-peer report runs/`: one Markdown table of every run under a log directory, and a PNG of val/acc
against time, so a volunteer swarm and DDP/FSDP runs of the same model can be compared side by side.

Local runs are read from their ``summary.json``; swarm runs from the monitor's TensorBoard run (with
TensorBoard's own reader) and its ``config.yaml``, or, without a monitor, from the peers' summaries.
A figure that a run did not record shows as ``n/a``, never as zero.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitor.board import EVAL_ACC
from swarm.net.metrics import SWARM_EPOCH, SWARM_PEERS, TRAIN_DATA_EPOCH, VAL_ACC
from swarm.training.logbook import read_scalars

COLUMNS = (
    "run",
    "strategy",
    "world size",
    "global batch",
    "largest batch found",
    "epochs",
    "data epochs",
    "best val/acc",
    "test acc",
    "training time (s)",
    "samples/s",
    "peak mem/device (GB)",
    "mean GPU util (%)",
)


@dataclass
class RunRow:
    """One run's figures; None means the run did not record it."""

    run: str
    strategy: str
    world_size: int | None = None
    global_batch: int | None = None
    batch_found: int | None = None
    epochs: int | None = None
    data_epochs: float | None = None  # passes over the training set
    best_acc: float | None = None
    test_acc: float | None = None  # `swarm-peer evaluate` of one of its checkpoints, if one was run
    train_seconds: float | None = None
    samples_per_second: float | None = None
    peak_mem_gb: float | None = None
    gpu_util: float | None = None
    curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, val acc)

    def cells(self) -> list[str]:
        def fmt(value: Any, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        return [
            self.run,
            self.strategy,
            fmt(self.world_size, "d"),
            fmt(self.global_batch, "d"),
            fmt(self.batch_found, "d"),
            fmt(self.epochs, "d"),
            fmt(self.data_epochs, ".2f"),
            fmt(self.best_acc, ".4f"),
            fmt(self.test_acc, ".4f"),
            fmt(self.train_seconds, ".1f"),
            fmt(self.samples_per_second, ".1f"),
            fmt(self.peak_mem_gb, ".2f"),
            fmt(self.gpu_util, ".0f"),
        ]


def local_row(s: dict[str, Any], folder: Path, root: Path) -> RunRow:
    """A `swarm-peer local` run from its summary.json (already read into ``s``)."""
    return RunRow(
        run=str(folder.relative_to(root)),
        strategy=f"{s['strategy']} ({s['accelerator']}"
        + (f" x{s['devices']} in one process" if s["strategy"] == "dp" else "")
        + f", {s['precision']})",
        world_size=s.get("world_size"),
        global_batch=s.get("global_batch"),
        batch_found=s.get("batch_size_found"),
        epochs=s.get("global_epochs"),
        data_epochs=s.get("data_epochs"),
        best_acc=s.get("best_val_acc"),
        train_seconds=s.get("train_seconds"),
        samples_per_second=s.get("samples_per_second"),
        peak_mem_gb=s.get("peak_allocated_gb"),
        gpu_util=s.get("mean_gpu_util"),
        curve=[(t, acc) for t, _, acc in s.get("val_curve", [])],
    )


def _target_batch(folder: Path) -> int | None:
    import yaml

    try:
        return int(yaml.safe_load((folder / "config.yaml").read_text())["swarm"]["target_batch_size"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def monitor_row(folder: Path, root: Path) -> RunRow | None:
    """A swarm run as its monitor wrote it: runs/<run_id>/monitor."""
    scalars, _ = read_scalars(folder)
    epochs = scalars.get(SWARM_EPOCH, [])
    if not epochs:
        return None
    first, last = epochs[0], epochs[-1]
    per_epoch = (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else None
    start = first[0] - (per_epoch or 0.0) * first[1]  # the run began about first-step epochs earlier
    val = scalars.get(EVAL_ACC) or scalars.get(VAL_ACC, [])  # the monitor's own evaluation first
    target = _target_batch(folder)
    return RunRow(
        run=str(folder.relative_to(root)),
        strategy="swarm (hivemind)",
        world_size=int(max(v for _, _, v in scalars[SWARM_PEERS])) if SWARM_PEERS in scalars else None,
        global_batch=target,
        epochs=int(last[2]),
        data_epochs=scalars[TRAIN_DATA_EPOCH][-1][2] if scalars.get(TRAIN_DATA_EPOCH) else None,
        best_acc=max((v for _, _, v in val), default=None),
        train_seconds=last[0] - start if per_epoch is not None else None,
        # samples that went into optimizer steps per second: one global batch per epoch
        samples_per_second=target / per_epoch if per_epoch and target else None,
        curve=[(w - start, v) for w, _, v in val],
    )


def volunteer_row(folder: Path, root: Path) -> RunRow | None:
    """A swarm run without a monitor: the peers' own summaries in runs/<run_id>/volunteer/<peer>."""
    summaries = []
    for path in sorted(folder.glob("*/summary.json")):
        try:
            summaries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not summaries:
        return None
    history = [h for s in summaries for h in s.get("history", [])]
    start = min((s["history"][0]["time"] for s in summaries if s.get("history")), default=None)
    vals = sorted((h["time"] - start, h["val_acc"]) for h in history if "val_acc" in h and start is not None)
    rates = [s["mean_samples_per_second"] for s in summaries if s.get("mean_samples_per_second")]
    return RunRow(
        run=str(folder.relative_to(root)),
        strategy="swarm (hivemind, no monitor)",
        world_size=len(summaries),
        global_batch=_target_batch(next(folder.glob("*"))),
        epochs=max(s.get("final_epoch", 0) for s in summaries),
        data_epochs=max((s["data_epochs"] for s in summaries if "data_epochs" in s), default=None),
        best_acc=max((v for _, v in vals), default=None),
        train_seconds=max((s.get("seconds") or 0.0 for s in summaries), default=None) or None,
        samples_per_second=sum(rates) if rates else None,
        curve=vals,
    )


def collect(log_dir: Path) -> list[RunRow]:
    """Every run under ``log_dir`` (runs/<run_id>/<monitor|volunteer|strategy>), in path order."""
    rows: list[RunRow] = []
    for folder in sorted(p for p in log_dir.glob("*/*") if p.is_dir()):
        row = None
        if (folder / "summary.json").is_file():
            try:
                summary = json.loads((folder / "summary.json").read_text())
                if summary.get("kind") == "local":
                    row = local_row(summary, folder, log_dir)
            except (OSError, ValueError, KeyError):
                row = None
        elif folder.name == "monitor":
            row = monitor_row(folder, log_dir)
        elif folder.name == "volunteer" and not (folder.parent / "monitor").is_dir():
            row = volunteer_row(folder, log_dir)
        if row is not None:
            row.test_acc = test_accuracy(folder)
            rows.append(row)
    return rows


def test_accuracy(folder: Path) -> float | None:
    """The test accuracy that `swarm-peer evaluate` wrote for this run (``<run>/test/evaluation.json``)."""
    try:
        return float(json.loads((folder / "test" / "evaluation.json").read_text())["acc"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def markdown(rows: list[RunRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: list[RunRow], path: Path) -> None:
    """val/acc against minutes since each run started, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for row in rows:
        if row.curve:
            ax.plot([t / 60 for t, _ in row.curve], [a for _, a in row.curve], marker=".", label=row.run)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("val/acc")
    ax.set_title("Validation accuracy against time")
    ax.grid(alpha=0.3)
    if any(row.curve for row in rows):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(log_dir: str, out: str | None = None) -> tuple[str, Path, Path]:
    """Write report.md and report.png (into ``out``, default ``log_dir``); returns (table, md, png)."""
    root = Path(log_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"log directory {root} does not exist; pass the --log-dir your runs used")
    rows = collect(root)
    if not rows:
        raise FileNotFoundError(
            f"no runs under {root}: expected <run_id>/monitor, <run_id>/volunteer or "
            "<run_id>/<strategy>/summary.json"
        )
    target = Path(out) if out else root
    target.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    png = target / "report.png"
    plot(rows, png)
    md = target / "report.md"
    md.write_text(
        f"# Runs under {root}\n\nWritten {time.strftime('%Y-%m-%d %H:%M')} by `swarm-peer report`. "
        "Epochs are global epochs (optimizer steps of one global batch). Local runs: training time excludes "
        "validation. Swarm runs: time and samples/s are global batches completed per wall-clock second, "
        "averaging and waiting included.\n\n"
        f"{table}\n\n![val/acc against time]({png.name})\n"
    )
    return table, md, png
