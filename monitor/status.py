"""`swarm-peer status`: a one-screen summary of a running swarm, read from its DHT (it never trains)."""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any

from monitor.aggregate import banned_counts
from swarm.config import ExperimentConfig
from swarm.net import metrics, reach
from swarm.net.node import SwarmConnectionError, start_node
from swarm.procs import remove_stale_sockets


@dataclass
class SwarmStatus:
    run_id: str
    via: str
    records: list[metrics.LocalMetrics] = field(default_factory=list)
    progress: list[Any] = field(default_factory=list)
    target_batch_size: int = 0
    reachability: str = ""
    monitors: list[metrics.MonitorRecord] = field(default_factory=list)


def reachability(addresses: list[str], client_mode: bool, verdict: reach.Verdict | None = None) -> str:
    """Whether peers elsewhere can dial this machine: the swarm's dial-back check (``verdict``) where peers
    answered it, and what the addresses its p2p node listens on say."""
    if client_mode:
        return "client mode: this machine dials out only (right behind NAT; it cannot be an initial peer)"
    if verdict is not None and verdict.unreachable:
        return (
            f"no peer could dial this machine ({verdict.describe()}): behind NAT or a firewall. Peers "
            "here switch to client mode by themselves; to serve others, open the TCP port and pass "
            "--announce-maddr"
        )
    checked = f" ({verdict.describe()})" if verdict is not None and verdict.asked else ""
    ips = []
    for maddr in addresses:
        parts = maddr.split("/")
        try:
            ips.append(ipaddress.ip_address(parts[2]))
        except (IndexError, ValueError):
            continue
    public = sorted({str(ip) for ip in ips if ip.is_global})
    private = sorted({str(ip) for ip in ips if ip.is_private and not ip.is_loopback})
    if public:
        return (
            f"reachable from outside at {', '.join(public)} if the firewall allows the TCP port; "
            f"others can use this machine as an initial peer{checked}"
        )
    if private:
        return (
            f"only private addresses ({', '.join(private)}): peers outside this network cannot dial "
            f"it{checked}. Use --client-mode, or forward a port and pass "
            "--announce-maddr /ip4/<public ip>/tcp/<port>"
        )
    return f"loopback only: reachable from this machine alone (fine for a localhost swarm){checked}"


def collect(cfg: ExperimentConfig, timeout: float = 10.0) -> SwarmStatus:
    """Join the DHT of ``cfg.swarm.initial_peers``, read the metrics and progress records, and leave."""
    if not cfg.swarm.initial_peers:
        raise SwarmConnectionError("status needs --initial-peers: the address of any running peer or monitor")
    started = time.time()
    validators, _ = metrics.make_validators(cfg.swarm.run_id)
    node = None
    try:
        # inside the try: a p2p daemon that failed to bootstrap leaves its socket file behind too
        node = start_node(cfg.swarm, validators)
        dht = node.dht
        status = SwarmStatus(cfg.swarm.run_id, cfg.swarm.initial_peers[0])
        try:
            status.records = sorted(
                metrics.fetch(dht, cfg.swarm.run_id, timeout=timeout).values(), key=lambda r: r.peer_name
            )
            status.progress = metrics.fetch_progress(dht, cfg.swarm.run_id, timeout=timeout)
            status.monitors = metrics.fetch_monitors(dht, cfg.swarm.run_id, timeout=timeout)
        except TimeoutError:
            raise SwarmConnectionError(
                f"the swarm's records did not arrive within {timeout:.0f} s (a busy or distant DHT): run "
                "status again, or give it longer with --timeout"
            ) from None
        targets = [r.target_batch_size for r in status.records if r.target_batch_size]
        status.target_batch_size = max(targets) if targets else cfg.swarm.target_batch_size
        verdict = None if cfg.swarm.client_mode else reach.check(dht, every=True)
        status.reachability = reachability(
            [str(a) for a in dht.get_visible_maddrs()], cfg.swarm.client_mode, verdict
        )
    finally:
        if node is not None:
            node.stop()
        remove_stale_sockets(since=started, exclude_own=True, settle=2.0)
    return status


def swarm_epoch(status: SwarmStatus) -> tuple[int, list[tuple[str, int]]]:
    """(The swarm's global epoch, the claims left out of it as (PeerID, epoch)). hivemind takes the largest
    epoch of any progress record, and a record may claim any epoch (docs/hivemind-patches.md item 25); here a
    progress record more than one epoch ahead of every other record, progress or metrics (its own peer's
    metrics record included), is an unconfirmed claim. An honest peer ahead of the others publishes its
    metrics at its epoch too, and so confirms its own."""
    from hivemind.p2p import PeerID

    progress = [p for p in status.progress if not p.client_mode]
    metrics_epochs = [r.global_epoch for r in status.records]

    def others(p: Any) -> list[int]:
        return [q.epoch for q in progress if q is not p] + metrics_epochs

    claimed = [p for p in progress if (rest := others(p)) and p.epoch > max(rest) + 1]
    claims = []
    for p in claimed:
        try:
            peer = PeerID(p.peer_id).to_base58()
        except Exception:  # a malformed PeerID in a record that passed hivemind's schema
            peer = "?"
        claims.append((peer, p.epoch))
    kept = [p.epoch for p in status.progress if all(p is not c for c in claimed)]
    return max(kept + metrics_epochs, default=0), claims


def monitor_line(monitors: list[metrics.MonitorRecord], now: float) -> str:
    """What the monitors' records say: the newest epoch a monitor evaluated (and so holds as a checkpoint)."""
    if not monitors:
        return "none seen (`swarm-peer monitor` evaluates the swarm's model and keeps the best checkpoint)"
    newest = max(monitors, key=lambda m: m.time)
    several = f"; {len(monitors)} monitors" if len(monitors) > 1 else ""
    held = max(m.saved_epoch for m in monitors)
    what = f"holds global epoch {held}" if held >= 0 else "up, nothing evaluated yet"
    return f"{what} (record renewed {max(0.0, now - newest.time):.0f} s ago{several})"


def render(status: SwarmStatus, now: float | None = None) -> str:
    """The summary as text, one screen (``now``: the DHT time to age the monitor's record by)."""
    from hivemind.utils import get_dht_time

    now = get_dht_time() if now is None else now
    lines = [f"Swarm {status.run_id!r} (asked {status.via})"]
    if not status.records and not status.progress:
        lines.append(
            "  no peer has published anything yet: check --run-id; peers report after their first "
            "global epoch"
        )
        lines.append(f"  this machine:   {status.reachability}")
        return "\n".join(lines)
    # hivemind's own progress records count a peer whose metrics record lapsed while it was busy
    # (downloading state, or stuck in a long round), so the larger of the two counts is the live one
    trainers = [p for p in status.progress if p.samples_per_second > 0 or p.samples_accumulated > 0]
    epoch, claims = swarm_epoch(status)
    at_epoch = [p for p in status.progress if p.epoch == epoch]
    accumulated = sum(p.samples_accumulated for p in at_epoch)
    newest = max((r.global_epoch for r in status.records), default=0)
    sps = sum(r.samples_per_second for r in status.records if r.global_epoch >= newest - 2)
    target = status.target_batch_size
    eta = f", next step in ~{max(0.0, (target - accumulated) / sps):.1f} s" if sps > 0 else ""
    percent = 100 * accumulated / max(target, 1)
    clients = sum(1 for p in status.progress if p.client_mode)
    lines += [
        f"  peers:          {max(len(status.records), len(trainers))} training ({clients} in client mode)",
        f"  global epoch:   {epoch}",
        f"  samples/s:      {sps:.1f} (sum over peers, averaging waits included)",
        f"  next step:      {accumulated} / {target} samples ({percent:.0f}%){eta}",
    ]
    for peer, claimed in claims:
        lines.append(
            f"  unconfirmed:    peer {peer} claims global epoch {claimed}, more than one epoch ahead of "
            "every other record (the peers count it at their own epoch once no donor serves that state)"
        )
    validated = [r for r in status.records if r.val_acc is not None and r.val_epoch is not None]
    if validated:
        latest = max(r.val_epoch for r in validated)
        group = [r for r in validated if r.val_epoch == latest]
        n = sum(r.val_samples for r in group) or len(group)
        acc = sum(r.val_acc * (r.val_samples or 1) for r in group) / n
        who = f"{len(group)} peers" if len(group) > 1 else "1 peer"
        lines.append(f"  val acc:        {acc:.4f} at global epoch {latest} ({who})")
    else:
        lines.append("  val acc:        none reported yet")
    lines.append(f"  monitor:        {monitor_line(status.monitors, now)}")
    lines.append(f"  this machine:   {status.reachability}")
    if status.records:
        rejected = sum(r.rejected_rounds or 0 for r in status.records)
        if rejected:
            lines.append(
                f"  rejected:       {rejected} averaged rounds refused by peers' screens (outsized or "
                "non-finite updates: a peer sends bad numbers)"
            )
        for peer, banning in sorted(banned_counts(status.records).items()):
            lines.append(
                f"  suspect:        {peer} is banned by {banning} of {len(status.records)} peers (its "
                "gradients or parameters were far from, against or unrelated to its groupmates' round after "
                "round)"
            )
        lines.append(f"  {'peer':<20}{'epoch':>7}{'samples/s':>11}{'loss':>9}{'val acc':>12}{'rejected':>10}")
        for r in status.records:
            val = f"{r.val_acc:.3f}@{r.val_epoch}" if r.val_acc is not None else "n/a"
            lines.append(
                f"  {r.peer_name[:19]:<20}{r.global_epoch:>7}{r.samples_per_second:>11.1f}"
                f"{r.loss:>9.4f}{val:>12}{r.rejected_rounds or 0:>10}"
            )
    return "\n".join(lines)
