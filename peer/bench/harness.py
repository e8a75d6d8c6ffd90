"""The bench's harness: the measurement log (JSON lines), peers and local runs as subprocesses, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.layout import STARTING, read_summary
from swarm.procs import Child, ChildError

if TYPE_CHECKING:
    from peer.bench.cpubudget import CpuBudgets
    from peer.bench.netns import Lab


@dataclass(frozen=True)
class Options:
    """What the CLI's options set for the scenarios (each reads the ones it needs)."""

    samples: int | None = None  # None: the scenario's own default
    local_steps: int = 50
    peers: int = 2
    step_batch: int = 256
    peak_tflops: float | None = None
    seeds: int = 3
    wan_mbit: float = 20.0
    repeats: int = 3
    volunteers: int = 8
    quotas: tuple[float, float] = (0.1, 0.3)  # the slowest and the fastest volunteer's CPU, in cores
    link_mbit: float = 2.0  # a volunteer's upload (download: 4x)


class Built:
    """A lab resource used as a context manager: ``_build()`` on entry (``close()`` if that fails half-way),
    ``close()`` on exit."""

    def __enter__(self) -> Any:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


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
class Peer(Child):
    """``swarm-peer <args>`` (swarm/procs.py's Child), its output written to ``<log_dir>/<name>.log``;
    ``prefix`` wraps the command (``ip netns exec <ns>`` for a peer in a network namespace)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = [*(prefix or []), sys.executable, "-m", "peer", *args]
        super().__init__(name, cmd, echo=self._write, env=env)

    def _write(self, line: str) -> None:
        if not self.log.closed:
            print(line, file=self.log, flush=True)

    def join_address(self, timeout: float = 120) -> str:
        try:
            return super().join_address(timeout)
        except ChildError:
            raise RuntimeError(f"{self.name} printed no join line; see {self.log_path}") from None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self, grace: float = 15.0) -> int | None:
        code = super().stop(grace)
        self.log.close()
        return code


def summary(log_dir: Path, run: str, name: str) -> dict[str, Any]:
    return read_summary(log_dir, run, name)


STARTUP_S = 600.0


def swarm(
    bench: Bench,
    run: str,
    peers: int,
    args: list[str],
    env: dict[str, str] | None = None,
    seed: int = 0,
    lab: Lab | None = None,
    budgets: CpuBudgets | None = None,
    seconds: float = 1800,
) -> list[dict[str, Any]]:
    """A bootstrap peer and ``peers`` training peers (``swarm-peer join`` with ``args``, and config fields
    from ``env`` as SWARM_<FIELD> variables); their summaries. Peer i shuffles with seed ``seed * 100 + i``.
    With a ``lab`` (peer/bench/netns.py), the bootstrap runs in its namespace 0 and peer i in namespace i;
    with ``budgets`` (peer/bench/cpubudget.py), peer i and its helpers in CPU budget i - 1.

    Starting through a bootstrap (a DHT node that does not train), with ``--min-peers``, means no trainer runs
    ahead alone while the others start. Peers still training ``seconds`` after the first of them began are
    told to leave (SIGTERM: they write their summaries)."""
    common = ["--config", "demo", "--run-id", run, "--log-dir", str(bench.work)]

    def place(i: int) -> tuple[list[str], list[str]]:  # (command prefix, listen address) of process i
        budget = budgets.prefix(i - 1) if budgets is not None and i > 0 else []
        if lab is None:
            return budget, []
        # the budget first: `ip netns exec` mounts a sysfs of its own, without the cgroup tree
        return [*budget, *lab.prefix(i)], ["--host-maddr", f"/ip4/{lab.address(i)}/tcp/0"]

    prefix, listen = place(0)
    boot = Peer(f"{run}-bootstrap", ["bootstrap", *common, *listen], bench.work, env, prefix)
    started = [boot]
    try:
        address = boot.join_address(timeout=120)
        for i in range(peers):
            name = f"p{i + 1}"
            prefix, listen = place(i + 1)
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
                        str(seed * 100 + i + 1),
                        "--threads",
                        "1",
                        "--eval-every",
                        "100000",
                        "--log-every",
                        "10",
                        "--min-peers",
                        str(peers),
                        *listen,
                        *args,
                    ],
                    bench.work,
                    env,
                    prefix,
                )  # fmt: skip
            )
        # ``seconds`` of training: from the first peer that says it starts (start-up under a small CPU
        # budget takes minutes), and at most STARTUP_S more from the launch
        launched, began = time.monotonic(), None
        # a lone peer (--min-peers 1) waits for nobody and says nothing of it: its first validation marks it
        marks = (STARTING,) if peers > 1 else (STARTING, "Validation at global epoch")
        while any(p.proc.poll() is None for p in started[1:]):
            now = time.monotonic()
            if began is None and any(m in line for p in started[1:] for line in list(p.lines) for m in marks):
                began = now
            if now > (began if began is not None else launched + STARTUP_S) + seconds:
                break
            time.sleep(0.5)
        for p in started[1:]:  # all at once: a peer told first would leave the others a round short
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        # their exits waited for before stop(): its SIGTERM, a second one, would cut a peer's leaving short
        deadline = time.monotonic() + 60
        for p in started[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        codes = [p.stop(grace=15) for p in started[1:]]
    finally:
        for p in started:
            p.stop()
    if any(codes):
        raise RuntimeError(f"{run}: a peer failed (exit codes {codes}); logs in {bench.work}")
    return [summary(bench.work, run, f"p{i + 1}") for i in range(peers)]


def local(
    bench: Bench, run: str, strategy: str, devices: int, args: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``swarm-peer local`` (Lightning; gloo on the CPU) in its own process group; its summary."""
    log_dir = bench.work / "local"
    proc = Peer(
        f"{run}-{strategy}",
        ["local", "--config", "demo", "--run-id", run, "--log-dir", str(log_dir), "--strategy", strategy,
         "--devices", str(devices), "--device", "cpu", "--threads", "1", "--eval-every", "100000", *args],
        bench.work,
        env,
    )  # fmt: skip
    code = proc.wait(timeout=1800)
    if code:
        raise RuntimeError(f"local {strategy}: exit code {code}; see {proc.log_path}")
    found = sorted((log_dir / run).glob(f"{strategy}*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())


def peer_rate(s: dict[str, Any]) -> float:
    """A peer's samples/s over its training windows (validation excluded, averaging waits included)."""
    done = [h for h in s["history"] if h["mini_steps"] and h["samples_per_second"]]
    return sum(h["samples"] for h in done) / max(s["train_seconds"], 1e-9)  # the summary's sum of windows


def samples_per_epoch(sums: list[dict[str, Any]]) -> float:
    """The samples that all peers computed per global epoch, over the epochs in which one of them trained."""
    totals: dict[int, int] = {}
    for s in sums:
        for h in s["history"]:
            if h["mini_steps"]:
                totals[h["epoch"]] = totals.get(h["epoch"], 0) + h["samples"]
    return sum(totals.values()) / len(totals) if totals else 0.0


def rounds(s: dict[str, Any]) -> int:
    return max(s["final_epoch"] - (s.get("loaded_epoch") or 0), 1)


def table(rows: list[dict[str, Any]], scenario: str, header: list[str], cells: Any) -> str:
    """A markdown table of the rows of ``scenario`` ("" if none): ``cells(row)`` gives one line's cells."""
    rows = [r for r in rows if r["scenario"] == scenario]
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)
