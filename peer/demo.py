"""`swarm-peer bootstrap` (a DHT-only entry point) and `swarm-peer demo` (a whole swarm on 127.0.0.1).

The demo starts a monitor first (it starts the swarm, as a public machine would), then N training peers
that join through it. When the peers are done it stops the monitor and prints where the TensorBoard run
and ``best.ckpt`` are.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from peer.launcher import Launcher
from swarm.config import ExperimentConfig
from swarm.layout import summary_path
from swarm.net import metrics
from swarm.net.fingerprint import join_line_for
from swarm.net.node import DHTProcessDied, start_node
from swarm.procs import Child, ChildError, GracefulStop, own_children, remove_stale_sockets, stop_strays

log = logging.getLogger(__name__)


def run_bootstrap(cfg: ExperimentConfig, config_name: str | None = None) -> None:
    """Hold the swarm's DHT open for others until SIGINT or SIGTERM; never trains."""
    started = time.time()
    stop = GracefulStop()
    stop.install()
    validators, _ = metrics.make_validators(cfg.swarm.run_id)
    node, died = None, []
    children = own_children()
    try:
        node = start_node(cfg.swarm, validators)
        died = node.watch(stop)
        print(
            f"Bootstrap peer of run {cfg.swarm.run_id!r} is up. To join, run:\n"
            f"  {join_line_for(node, cfg, config_name)}",
            flush=True,
        )
        while not stop.event.wait(1.0):
            pass
    finally:
        stop.restore()
        if node is not None:
            node.stop()
        stop_strays(children)  # a DHT process forked after a signal to the group (swarm.procs.stop_strays)
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)
    if died:
        raise DHTProcessDied(died[0])


def _start(name: str, cmd: list[str], launcher: Launcher | None) -> Child:
    """``cmd`` as a Child (swarm/procs.py) whose lines are printed with its name in front, forked from
    ``launcher`` (a fresh interpreter if the launcher failed)."""

    def echo(line: str) -> None:
        print(f"[{name:>9}] {line}", flush=True)

    if launcher is not None:
        try:
            return Child(name, cmd, echo=echo, launcher=launcher)
        except (RuntimeError, OSError) as exc:
            log.warning("Starting %s as a fresh interpreter: %s", name, exc)
    return Child(name, cmd, echo=echo)


def _summarise(cfg: ExperimentConfig, names: list[str]) -> list[dict]:
    out = []
    for name in names:
        path = summary_path(cfg.train.log_dir, cfg.swarm.run_id, name)
        if path.is_file():
            out.append(json.loads(path.read_text()))
    return out


def _print_monitor(cfg: ExperimentConfig) -> None:
    """Where to look next: the TensorBoard command and the best checkpoint with its accuracy."""
    from monitor.state import BEST
    from swarm.training.checkpoint import CheckpointError, join_url, load_checkpoint

    run_dir = Path(cfg.train.log_dir) / cfg.swarm.run_id
    best = join_url(cfg.checkpoint_dir, BEST)
    try:
        payload = load_checkpoint(best, cfg.checkpoint.s3_endpoint_url)
        acc = payload["metrics"].get("val/acc")
        about = f"val acc {acc:.3f} at global epoch {payload['global_epoch']} (the monitor's own evaluation)"
    except CheckpointError as exc:
        about = f"not written ({exc})"
    print(f"best checkpoint: {best}: {about}")
    print(f"TensorBoard:     tensorboard --logdir {run_dir}   (then open http://localhost:6006)")


def _print_summary(cfg: ExperimentConfig, summaries: list[dict], wall: float) -> None:
    print("\n=== demo summary ===")
    print(
        f"{'peer':<10}{'global epoch':>13}{'val acc':>9}{'samples/s':>11}{'first loss':>12}{'last loss':>11}"
    )
    for s in summaries:
        val = (s.get("final_val") or {}).get("acc")
        print(
            f"{s['peer_name']:<10}{s['final_epoch']:>13}{(val if val is not None else float('nan')):>9.3f}"
            f"{(s['mean_samples_per_second'] or 0):>11.1f}{(s['first_loss'] or float('nan')):>12.3f}"
            f"{(s['last_loss'] or float('nan')):>11.3f}"
        )
    if summaries:
        epochs = max(s["final_epoch"] for s in summaries)
        histories = [h for s in summaries for h in s["history"] if h["mini_steps"]]
        span = (max(h["time"] for h in histories) - min(h["time"] for h in histories)) if histories else 0
        per_epoch = span / max(1, len({h["epoch"] for h in histories}) - 1)
        swarm_sps = sum(s["mean_samples_per_second"] or 0 for s in summaries)
        first = summaries[0].get("initial_val")
        accs = ([(first["epoch"], first["acc"])] if first else []) + [
            (h["epoch"], h["val_acc"]) for h in summaries[0]["history"] if "val_acc" in h
        ]
        print(
            f"global epochs: {epochs} | {per_epoch:.1f} s per global epoch | swarm {swarm_sps:.1f} samples/s "
            f"| target batch {cfg.swarm.target_batch_size}"
        )
        if accs:
            print("val acc by global epoch: " + ", ".join(f"{e}: {a:.3f}" for e, a in accs))
    print(f"wall time {wall:.0f} s; logs and summaries under {Path(cfg.train.log_dir) / cfg.swarm.run_id}")


def _demo_invites(cfg: ExperimentConfig, names: list[str]) -> dict[str, str]:
    """A new owner key and one invite per process of the demo (valid for a day) under the run's folder; their
    paths by name. One each, as the owner hands them to volunteers: a newcomer's download check counts one
    vote per invite (swarm/averaging/donors.py)."""
    from swarm.net.invite import describe, load_or_create_owner_key, make_invite

    run_dir = Path(cfg.train.log_dir) / cfg.swarm.run_id
    key, _ = load_or_create_owner_key(run_dir / "owner.pem")
    paths = {}
    for name in names:
        invite = make_invite(key, cfg.swarm.run_id, name, 86400.0)
        path = run_dir / "invites" / f"{name}.tok"
        path.parent.mkdir(parents=True, exist_ok=True)
        invite.save(path)
        paths[name] = str(path)
    print(
        f"Invite-only swarm: owner key {run_dir / 'owner.pem'}, one invite per process ({describe(invite)}, "
        f"and the others) in {run_dir / 'invites'}; `swarm-peer demo --open` runs an open one",
        flush=True,
    )
    return paths


def _wait_for_peers(peers: dict[str, Child], poll: float = 0.5) -> dict[str, int]:
    """Each peer's exit code once it ends; stops waiting when one fails while others run (they wait for it
    with --min-peers): the caller then stops the rest."""
    codes: dict[str, int] = {}
    while len(codes) < len(peers):
        for name, child in peers.items():
            code = child.proc.poll()
            if name not in codes and code is not None:
                codes[name] = code
                if code != 0 and len(codes) < len(peers):
                    log.error("%s exited with code %d before the others; stopping the demo", name, code)
                    return codes
        time.sleep(poll)
    return codes


def run_demo(cfg: ExperimentConfig, config_name: str, n_peers: int, invite_only: bool = True) -> int:
    """Start a monitor and ``n_peers`` training peers on 127.0.0.1; 0 if every peer finished cleanly.
    Invite-only unless ``invite_only`` is false: every peer uses ``cfg.swarm.invite``, or an invite of its own
    that the demo makes."""
    started = time.time()
    base = [sys.executable, "-m", "peer"]
    common = ["--config", config_name, "--run-id", cfg.swarm.run_id, "--log-dir", cfg.train.log_dir]
    names = [f"peer{i + 1}" for i in range(n_peers)]
    invites: dict[str, list[str]] = {name: [] for name in ["monitor", *names]}
    if invite_only:
        given = cfg.swarm.invite
        paths = dict.fromkeys(invites, given) if given else _demo_invites(cfg, list(invites))
        invites = {name: ["--invite", path] for name, path in paths.items()}
    procs: dict[str, Child] = {}
    interrupted = False
    codes: dict[str, int | None] = {}

    def terminated(signum: int, frame: Any) -> None:  # `kill`, `timeout`, a service manager: as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    # the monitor and the peers are forked from one process that imported their modules once: each fresh
    # interpreter would spend 5-6 CPU-s on imports, all at once on the demo's machine
    launcher = Launcher()
    try:
        monitor = procs["monitor"] = _start(
            "monitor",
            base
            + ["monitor", *common, *invites["monitor"], "--host-maddr", "/ip4/127.0.0.1/tcp/0"]
            + ["--threads", "1"],
            launcher,
        )
        try:
            address = monitor.join_address(timeout=120)
        except ChildError:
            log.error("The monitor did not come up; see its output above")
            return 1
        for i, name in enumerate(names):
            cmd = base + [
                "join",
                *common,
                *invites[name],
                "--initial-peers",
                address,
                "--peer-name",
                name,
                "--seed",
                str(i + 1),
                "--host-maddr",
                "/ip4/127.0.0.1/tcp/0",
                "--threads",
                "1",
                # started together, they take their first step together: a peer that comes up a few seconds
                # before the others would otherwise train alone at 10 global epochs a second (a fresh clone's
                # demo: 55 of its 160 epochs, val acc 0.875 at the end)
                "--min-peers",
                str(n_peers),
            ]
            if cfg.train.max_epochs is not None:
                cmd += ["--max-epochs", str(cfg.train.max_epochs)]
            procs[name] = _start(name, cmd, launcher)
        codes.update(_wait_for_peers({name: procs[name] for name in names}))
    except KeyboardInterrupt:
        interrupted = True
        print("\nInterrupted: stopping every peer of the demo ...", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the peers are stopped in order below, whatever comes
        for name, child in reversed(list(procs.items())):
            code = child.stop(grace=30.0)  # the monitor finishes its TensorBoard points and checkpoint
            if name == "monitor" and not interrupted:
                codes[name] = code if code is not None else 0
        launcher.close()
        remove_stale_sockets(since=started, settle=3.0)
        signal.signal(signal.SIGTERM, previous)
    _print_summary(cfg, _summarise(cfg, [n for n in procs if n != "monitor"]), time.time() - started)
    _print_monitor(cfg)
    if interrupted:
        return 130
    failed = {n: c for n, c in codes.items() if c != 0}
    if failed:
        log.error("Peers exited with errors: %s", failed)
    return 1 if failed else 0
