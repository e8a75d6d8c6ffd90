"""Turn the peers' per-epoch metrics records into one point per global epoch (pure logic, no I/O).

Each peer overwrites its own DHT record once per global epoch, so a record is visible only until the
peer's next epoch. The monitor polls every few seconds and files every record it sees under its epoch.
Epoch E is written once it is complete: when every live peer (if any is left) has reported E (or later)
and ``settle_time`` seconds have passed since E was first seen, or when the swarm is at E+2, or at E+1 for
``settle_time`` seconds (a lagging peer does not hold the log back). Late records, e.g. from a peer that was
validating, still count within that window.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from swarm.net.metrics import ROUND_PARTS, LocalMetrics


@dataclass(frozen=True)
class EpochPoint:
    """The swarm's figures for one global epoch; val_* are None when no peer validated at that epoch."""

    epoch: int
    peers: int
    samples_per_second: float
    loss: float | None
    val_loss: float | None = None
    val_acc: float | None = None
    val_samples: int = 0
    train_records: int = 1  # records that reported training at this epoch (0: only validations seen)
    rounds: dict[str, float] = field(default_factory=dict)  # part -> median seconds over reporting peers
    local_steps: int = 0  # peers whose gradient round failed (they stepped on their own gradient)
    rejected: int = 0  # peers whose screen refused this epoch's averaged result (swarm/averaging/screen.py)
    data_epoch: float | None = None  # passes over the training set (the peers' own count; the largest)
    gpus: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (GPU memory GB, util %)
    clipped: int = 0  # senders' parts the peers' robust means scaled down since their last records
    # groupmate PeerID -> how many of the reporting peers ban it (swarm/suspects.py)
    suspects: dict[str, int] = field(default_factory=dict)


def banned_counts(records: list[LocalMetrics]) -> dict[str, int]:
    """Groupmate PeerID -> how many of ``records``' peers ban it (swarm/suspects.py)."""
    return dict(Counter(peer for r in records for peer in set(r.banned or ())))


def aggregate(
    epoch: int, records: list[LocalMetrics], peers: int, vals: list[LocalMetrics] | None = None
) -> EpochPoint:
    """Sum samples/s over peers, weight the loss by samples and validation figures by validation samples.

    ``vals``: records (of this epoch or later ones) that carry a validation of ``epoch``; by default the
    validations among ``records``."""
    sps = sum(r.samples_per_second for r in records)
    weighted = [
        (r.loss, r.samples_accumulated) for r in records if r.mini_steps > 0 and r.samples_accumulated
    ]
    total = sum(n for _, n in weighted)
    loss = sum(v * n for v, n in weighted) / total if total else None
    vals = [r for r in (records if vals is None else vals) if r.val_epoch == epoch and r.val_samples > 0]
    vals = [r for r in vals if r.val_acc is not None]
    n_val = sum(r.val_samples for r in vals)
    val_loss = val_acc = None
    if n_val:
        val_acc = sum(r.val_acc * r.val_samples for r in vals) / n_val
        with_loss = [r for r in vals if r.val_loss is not None]
        n_loss = sum(r.val_samples for r in with_loss)
        val_loss = sum(r.val_loss * r.val_samples for r in with_loss) / n_loss if n_loss else None
    rounds = {}
    for part in ROUND_PARTS:
        values = [getattr(r, f"round_{part}") for r in records if getattr(r, f"round_{part}") is not None]
        if values:
            rounds[part] = statistics.median(values)
    local = sum(bool(r.round_local) for r in records)
    rejected = sum(bool(r.round_rejected) for r in records)
    data_epochs = [r.data_epoch for r in records if r.data_epoch is not None]
    return EpochPoint(
        epoch,
        peers,
        sps,
        loss,
        val_loss,
        val_acc,
        n_val,
        len(records),
        rounds,
        local,
        rejected,
        max(data_epochs) if data_epochs else None,
        {r.peer_name: (r.gpu_mem_gb, r.gpu_util or 0.0) for r in records if r.gpu_mem_gb is not None},
        sum(r.round_clipped or 0 for r in records),
        banned_counts(records),
    )


class EpochAggregator:
    """Collects records across polls and releases finished epochs in increasing order, each once."""

    def __init__(self, settle_time: float = 5.0, after_epoch: int = -1) -> None:
        self.settle_time = settle_time
        self.after_epoch = after_epoch  # epochs <= this were written before (a restarted monitor)
        self.pending: dict[int, dict[bytes, LocalMetrics]] = {}
        self.vals: dict[int, dict[bytes, LocalMetrics]] = {}  # by validated epoch: records that carry it
        self.first_seen: dict[bytes, int] = {}
        self.latest: dict[bytes, int] = {}
        self.newest_epoch = -1
        self.newest_since = 0.0
        self.seen_at: dict[int, float] = {}

    def add(self, records: dict[bytes, LocalMetrics], now: float) -> None:
        """File one poll's live (unexpired) records."""
        for key, record in records.items():
            epoch = record.global_epoch
            self.first_seen[key] = min(self.first_seen.get(key, epoch), epoch)
            self.latest[key] = max(self.latest.get(key, epoch), epoch)
            if epoch > self.newest_epoch:
                self.newest_epoch, self.newest_since = epoch, now
            if epoch > self.after_epoch:
                self.pending.setdefault(epoch, {})[key] = record
                self.seen_at.setdefault(epoch, now)
            val_epoch = record.val_epoch
            if val_epoch is not None and val_epoch > self.after_epoch and record.val_samples > 0:
                self.vals.setdefault(val_epoch, {})[key] = record
                self.pending.setdefault(val_epoch, {})  # a point even if its own records were missed
                self.seen_at.setdefault(val_epoch, now)
        # a peer whose record expired has left: it no longer counts for later epochs
        for key in list(self.latest):
            if key not in records:
                self.first_seen.pop(key, None)
                self.latest.pop(key, None)

    @property
    def filed_epoch(self) -> int:
        """The newest epoch to which every live peer's records were filed (-1: no peer seen)."""
        return min(self.latest.values(), default=-1)

    def _peers_at(self, epoch: int) -> int:
        """Peers that reported ``epoch``, plus live peers that were seen both before and after it."""
        reported = set(self.pending.get(epoch, {}))
        spanning = {k for k in self.latest if self.first_seen[k] < epoch < self.latest[k]}
        return len(reported | spanning)

    def _complete(self, epoch: int, now: float, closing: bool) -> bool:
        if self.newest_epoch >= epoch + 2:
            return True
        waited = closing or now - self.seen_at.get(epoch, now) >= self.settle_time
        # every live peer: once the peers have left (their records vanish with them, right after a final
        # epoch's records were read), nobody is left to wait for
        everyone = all(e >= epoch for e in self.latest.values())
        moved_on = self.newest_epoch >= epoch + 1 and (closing or now - self.newest_since >= self.settle_time)
        return (everyone and waited) or moved_on

    def ready(self, now: float, closing: bool = False) -> list[EpochPoint]:
        """Points for every complete epoch, oldest first. ``closing``: the monitor stops, do not wait."""
        out = []
        for epoch in sorted(self.pending):
            if not self._complete(epoch, now, closing):
                break
            peers = self._peers_at(epoch)
            records = list(self.pending.pop(epoch).values())
            self.seen_at.pop(epoch, None)
            vals = list(self.vals.pop(epoch, {}).values())
            out.append(aggregate(epoch, records, peers, vals))
            self.after_epoch = epoch
        return out
