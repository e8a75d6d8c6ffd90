"""The bench's harness: the measurement log (JSON lines), peers and local runs as subprocesses, tables."""

from __future__ import annotations

import contextlib
import dataclasses
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
    attacks: tuple[str, ...] = ()  # attack: only the rows whose attacker column contains one of these


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


@dataclass
class Incarnation:
    """One process of a churned peer's slot: its name, when it was launched and (if so) killed."""

    slot: int  # 1..peers
    name: str
    launched: float  # time.time()
    killed: float | None = None

    @property
    def newcomer(self) -> bool:
        """Started in place of a killed one (named ``p<slot>-<n>``), not with the swarm."""
        return self.name != f"p{self.slot}"


@dataclass
class Churn:
    """Peers replaced while a swarm trains, the way a Colab session ends: every ``every`` seconds (drawn from
    the range) after training began, ``fraction`` of the peers, chosen at random, are killed (SIGKILL to
    the whole process group: no goodbye, no summary at leaving) and a new one starts in the same slot (the
    same namespace and CPU budget, a new name and seed). ``incarnations`` records every process."""

    every: tuple[float, float] = (30.0, 60.0)
    fraction: float = 0.2
    seed: int = 0
    incarnations: list[Incarnation] = field(default_factory=list)

    def __post_init__(self) -> None:
        import random

        self._rng = random.Random(self.seed)
        self._next: float | None = None

    def due(self, trained: float, peers: int) -> list[int]:
        """The slots to replace now, ``trained`` seconds after training began (none before it is time)."""
        if self._next is None:
            self._next = self._rng.uniform(*self.every)
        if trained < self._next:
            return []
        self._next += self._rng.uniform(*self.every)
        count = max(1, round(peers * self.fraction))
        return sorted(self._rng.sample(range(1, peers + 1), count))


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
    churn: Churn | None = None,
) -> list[dict[str, Any]]:
    """A bootstrap peer and ``peers`` training peers (``swarm-peer join`` with ``args``, and config fields
    from ``env`` as SWARM_<FIELD> variables); their summaries. Peer i shuffles with seed ``seed * 100 + i``.
    With a ``lab`` (peer/bench/netns.py), the bootstrap runs in its namespace 0 and peer i in namespace i;
    with ``budgets`` (peer/bench/cpubudget.py), peer i and its helpers in CPU budget i - 1.

    Starting through a bootstrap (a DHT node that does not train), with ``--min-peers``, means no trainer runs
    ahead alone while the others start. Peers still training ``seconds`` after the first of them began are
    told to leave (SIGTERM: they write their summaries).

    With ``churn``, peers are replaced while the swarm trains (:class:`Churn`); the summaries returned are
    then those of every incarnation that wrote one (a peer writes its summary at every global epoch), in the
    order of ``churn.incarnations``."""
    common = ["--config", "demo", "--run-id", run, "--log-dir", str(bench.work)]

    def place(i: int) -> tuple[list[str], list[str]]:  # (command prefix, listen address) of process i
        budget = budgets.prefix(i - 1) if budgets is not None and i > 0 else []
        if lab is None:
            return budget, []
        # the budget first: `ip netns exec` mounts a sysfs of its own, without the cgroup tree
        return [*budget, *lab.prefix(i)], ["--host-maddr", f"/ip4/{lab.address(i)}/tcp/0"]

    def launch(i: int, name: str, peer_seed: int, min_peers: int) -> Peer:
        prefix, listen = place(i)
        flags = ["--peer-name", name, "--seed", str(peer_seed), "--threads", "1", "--eval-every", "100000",
                 "--log-every", "10", "--min-peers", str(min_peers)]  # fmt: skip
        cmd = ["join", *common, "--initial-peers", address, *flags, *listen, *args]
        return Peer(f"{run}-{name}", cmd, bench.work, env, prefix)

    prefix, listen = place(0)
    boot = Peer(f"{run}-bootstrap", ["bootstrap", *common, *listen], bench.work, env, prefix)
    started = [boot]
    slots: dict[int, Peer] = {}  # the live process of each slot
    lives: dict[int, Incarnation] = {}  # and what churn records of it
    try:
        address = boot.join_address(timeout=120)
        for i in range(1, peers + 1):
            slots[i] = launch(i, f"p{i}", seed * 100 + i, peers)
            started.append(slots[i])
            if churn is not None:
                lives[i] = Incarnation(i, f"p{i}", time.time())
                churn.incarnations.append(lives[i])
        # ``seconds`` of training: from the first peer that says it starts (start-up under a small CPU
        # budget takes minutes), and at most STARTUP_S more from the launch
        launched, began = time.monotonic(), None
        # a lone peer (--min-peers 1) waits for nobody and says nothing of it: its first validation marks it
        marks = (STARTING,) if peers > 1 else (STARTING, "Validation at global epoch")
        while any(p.proc.poll() is None for p in slots.values()):
            now = time.monotonic()
            if began is None and any(m in line for p in started[1:] for line in list(p.lines) for m in marks):
                began = now
            if now > (began if began is not None else launched + STARTUP_S) + seconds:
                break
            if churn is not None and began is not None:
                for i in churn.due(now - began, peers):
                    _kill(slots[i])
                    lives[i].killed = time.time()
                    n = sum(c.slot == i for c in churn.incarnations)
                    name = f"p{i}-{n + 1}"
                    slots[i] = launch(i, name, seed * 100 + i + 10 * n, 1)  # a newcomer waits for nobody
                    started.append(slots[i])
                    lives[i] = Incarnation(i, name, time.time())
                    churn.incarnations.append(lives[i])
            time.sleep(0.5)
        live = list(slots.values())
        for p in live:  # all at once: a peer told first would leave the others a round short
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        # their exits waited for before stop(): its SIGTERM, a second one, would cut a peer's leaving short
        deadline = time.monotonic() + 60
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        stuck = [p for p in live if p.proc.poll() is None]
        for p in stuck:  # where it hangs, in its log: a peer prints every thread's stack on SIGUSR1 (cli.py)
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGUSR1)
        if stuck:
            time.sleep(1.0)
        codes = [p.stop(grace=15) for p in live]
    finally:
        for p in started:
            p.stop()
    # a newcomer told to leave while it still started (imports, under a small CPU budget) dies of SIGTERM;
    # one that did not leave within the waits above was SIGKILLed: said, and not counted as a failed run
    hung = [
        p.name
        for p, code in zip(live, codes, strict=True)
        if churn is not None and code in (-signal.SIGKILL, -signal.SIGUSR1) and not _trained(p)
    ]
    if hung:
        print(f"{run}: {', '.join(hung)}, still starting when told to leave, had to be killed", flush=True)
    failed = [
        code
        for p, code in zip(live, codes, strict=True)
        if code and not (churn is not None and (code == -signal.SIGTERM or p.name in hung))
    ]
    if failed:
        raise RuntimeError(f"{run}: a peer failed (exit codes {codes}); logs in {bench.work}")
    if churn is None:
        return [summary(bench.work, run, f"p{i + 1}") for i in range(peers)]
    found = []
    for c in churn.incarnations:
        with contextlib.suppress(FileNotFoundError):
            found.append({**summary(bench.work, run, c.name), "incarnation": dataclasses.asdict(c)})
    return found


def _trained(p: Peer) -> bool:
    """Whether ``p`` had begun to train (a validation or a progress line)."""
    return any("Validation at global epoch" in line or "| epoch " in line for line in list(p.lines))


def _kill(p: Peer) -> None:
    """The machine under ``p`` is gone: SIGKILL its whole process group (trainer, DHT, p2p daemon,
    averagers), no goodbye."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.proc.pid, signal.SIGKILL)
    p.stop(grace=5)


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
    # a peer stopped while it started (a newcomer under churn) left a summary without any of these
    done = [h for h in s.get("history", []) if h["mini_steps"] and h["samples_per_second"]]
    return sum(h["samples"] for h in done) / max(s.get("train_seconds", 0.0), 1e-9)  # the sum of windows


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
