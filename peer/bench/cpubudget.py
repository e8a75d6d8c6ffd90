"""CPU budgets for a lab's volunteers: one cgroup per peer with a CPU quota (root only).

A volunteer's trainer, DHT process, p2p daemon and averagers share its one machine. :class:`CpuBudgets` makes
one cgroup per budget (cgroup v1's ``cpu`` controller, ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; on
cgroup v2, ``cpu.max``), and :meth:`CpuBudgets.prefix` gives the command prefix that moves a process into its
group before it execs the program: every process it starts inherits the group, so a peer's helpers spend
the same budget as its trainer. :meth:`CpuBudgets.close` removes the groups (once their processes are gone).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from peer.bench.harness import Built

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def unavailable() -> str | None:
    """Why CPU budgets cannot be set here (one line), or None if they can."""
    if os.geteuid() != 0:
        return "needs root (cgroup CPU quotas); run it as root"
    if not _root().exists():
        return "needs the cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2's cpu.max)"
    return None


def _root() -> Path:
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1
    return V2 if (V2 / "cgroup.controllers").exists() else V1 / "missing"


class CpuBudgets(Built):
    """One cgroup per quota (in cores: 0.25 is a quarter of one core)."""

    def __init__(self, quotas: Sequence[float], tag: str) -> None:
        if any(q <= 0 for q in quotas):
            raise ValueError(f"CPU quotas must be > 0 cores, not {list(quotas)}")
        self.quotas, self.tag = list(quotas), tag
        self.root = _root()
        self.made: list[Path] = []

    def path(self, i: int) -> Path:
        return self.root / f"swarmlab{self.tag}-{i}"

    def _build(self) -> None:
        for i, quota in enumerate(self.quotas):
            group = self.path(i)
            group.mkdir()
            self.made.append(group)
            if self.root == V1:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(round(quota * PERIOD_US)))
            else:
                (group / "cpu.max").write_text(f"{round(quota * PERIOD_US)} {PERIOD_US}")

    def prefix(self, i: int) -> list[str]:
        """A command prefix that runs the program in budget ``i`` (it joins the group, then execs)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path(i))]

    def throttled_seconds(self, i: int) -> float | None:
        """How long budget ``i``'s processes waited for their quota, in total (None where unknown)."""
        try:
            stat = dict(line.split() for line in (self.path(i) / "cpu.stat").read_text().splitlines())
        except (OSError, ValueError):
            return None
        if "throttled_time" in stat:  # v1: nanoseconds
            return int(stat["throttled_time"]) / 1e9
        return int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat else None

    def close(self) -> None:
        """Remove the groups (a group with processes left in it is retried for a few seconds)."""
        for group in reversed(self.made):
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.made.clear()
