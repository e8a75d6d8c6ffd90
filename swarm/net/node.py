"""The only module that creates a hivemind.DHT: :func:`start_node` returns this process's :class:`SwarmNode`.

Every role (training peer, bootstrap, monitor) joins the swarm through :func:`start_node`, so address
checks, the signed-record validators, the invite, the reachability check and the error messages for
unreachable peers live in one place. The node holds what came with the DHT (the invite, read and verified
once; the revocation watcher; the reachability verdict; the fence of the averagers) and stops all of it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shlex
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from swarm.config import SwarmConfig
from swarm.layout import join_line
from swarm.net import reach as reachability
from swarm.net.authorizer import InviteAuthorizer, RevocationWatcher
from swarm.net.invite import Invite, load_invite
from swarm.patches.dht import SwarmDHT
from swarm.procs import (
    SHUTDOWN_GRACE_S,
    GracefulStop,
    control_socket,
    is_p2p_daemon,
    p2p_daemon_alive,
    p2p_daemons,
    running,
)

if TYPE_CHECKING:
    import hivemind

    from swarm.net.fence import Fence, MemberKeeper

log = logging.getLogger(__name__)


# The p2p daemon (Go) with one OS thread running Go code and a garbage collection when its heap has grown 4x,
# not 2x: it spends its CPU on many small messages (DHT requests, round control), and those defaults cost a
# volunteer's small CPU about a quarter of the daemon's share (docs/benchmarks.md, "The p2p daemon's CPU").
# A value already in the environment wins.
DAEMON_ENV = {"GOMAXPROCS": "1", "GOGC": "400"}
DHT_WATCH_S = 1.0  # how often SwarmNode.watch looks whether the DHT process still runs


def lean_daemon_env() -> None:
    """Put :data:`DAEMON_ENV` into this process's environment (where not set), which hivemind passes to every
    p2p daemon it starts from now on: the DHT's, and the reachability probe's (started by the DHT process)."""
    for name, value in DAEMON_ENV.items():
        os.environ.setdefault(name, value)


class SwarmConnectionError(RuntimeError):
    """This peer could not start or reach the swarm; the message says what to check."""


class DHTProcessDied(SwarmConnectionError):
    """This peer's DHT process exited under it (:meth:`SwarmNode.watch`); raised once the peer has left.
    Requests to the dead process never get an answer, so threads that made one never end: leave with
    ``os._exit``, not through the interpreter's teardown, which joins them."""


def check_multiaddrs(maddrs: Sequence[str], option: str, need_peer_id: bool = False) -> None:
    """Raise ValueError naming ``option`` if any address is not a valid multiaddr."""
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
        except Exception as exc:  # the multiaddr library raises several unrelated types
            raise ValueError(
                f"{option} {maddr!r} is not a multiaddr ({exc}); expected e.g. /ip4/1.2.3.4/tcp/31337"
                + ("/p2p/Qm..." if need_peer_id else "")
            ) from None
        if need_peer_id and "p2p" not in [p.name for p in parsed.protocols()]:
            raise ValueError(
                f"{option} {maddr!r} lacks the /p2p/<peer id> part; copy the whole line a peer printed"
            )


def check_addresses(cfg: SwarmConfig, read_invite: bool = True) -> Invite | None:
    """Validate every multiaddr of ``cfg`` before any slow work, and (with ``read_invite``) read and verify
    its invite file: pass the invite returned to :func:`start_node`, which then reads no file. Raises
    ValueError (or InviteError, one of them) naming the option."""
    check_multiaddrs(cfg.initial_peers, "--initial-peers", need_peer_id=True)
    check_multiaddrs(cfg.host_maddrs, "--host-maddr")
    check_multiaddrs(cfg.announce_maddrs, "--announce-maddr")
    return load_invite(cfg.invite, cfg.run_id) if cfg.invite and read_invite else None


@dataclass(eq=False)
class SwarmNode:
    """This process's place in the swarm: its DHT (with the p2p daemon) and what came with it.

    ``invite`` is the invite this node joined with (read and verified once, by :func:`start_node`), None in
    an open swarm; ``revocations`` watches the owner's revocations of an invite-only run; ``reach`` is the
    dial-back check's :class:`swarm.net.reach.Verdict` (None if not checked); ``fence`` and ``members`` are
    set by :meth:`fence_averagers`. :meth:`stop` (or leaving a ``with`` block) stops all of it.
    """

    dht: hivemind.DHT
    invite: Invite | None = None
    revocations: RevocationWatcher | None = None
    reach: reachability.Verdict | None = None
    fence: Fence | None = None
    members: MemberKeeper | None = None
    daemons: list[int] = field(default_factory=list)  # the DHT's p2p daemon (PIDs), stopped if the DHT dies
    daemon_sockets: list[str] = field(default_factory=list)  # their control socket files, removed then
    stopping: threading.Event = field(default_factory=threading.Event)

    def watch(self, stop: GracefulStop, every: float = DHT_WATCH_S) -> list[str]:
        """Make the role leave (``stop.request``) if the DHT process exits before :meth:`stop`; returns a list
        that then holds why (:meth:`why_dead`), for the role to raise :class:`DHTProcessDied` once it has
        left. Without it nothing reaches the swarm: every DHT request, and each averaging round that needs
        one, waits for an answer that never comes, and the role would stop silently, holding its machine. A
        signal to the whole process group (Ctrl-C, a spot reclaim's SIGTERM) stops the DHT process too: then
        the role is leaving already, as its own handler says within moments (SIGKILL never is that)."""
        died: list[str] = []

        def run() -> None:
            while not self.stopping.wait(every):
                if self.dht.is_alive():
                    continue
                grace = 0.0 if self.dht.exitcode == -signal.SIGKILL else SHUTDOWN_GRACE_S
                if not self.stopping.is_set() and not stop.event.wait(grace):
                    died.append(self.why_dead())
                    stop.request("The DHT process exited")
                return

        threading.Thread(target=run, name="swarm-dht-watch", daemon=True).start()
        return died

    def why_dead(self) -> str:
        """One line: the DHT process exited, and what to do."""
        code = self.dht.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return (
            f"this peer's DHT process (PID {self.dht.pid}) exited ({how}), and without it the peer cannot "
            "reach the swarm; start the peer again to rejoin (the swarm keeps its state). Out of memory? See "
            "dmesg"
        )

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    def fence_averagers(self, public_key: bytes | None = None) -> None:
        """Invite-only: publish this peer's member record and fence the averagers built on this node from now
        on (swarm/net/fence.py). A no-op in an open swarm and after the first call. Call before any averager
        is built."""
        if self.invite is None or self.fence is not None:
            return
        from swarm.net.fence import fence_averagers

        self.fence, self.members = fence_averagers(self.dht, self.invite, public_key)

    def join_command(
        self,
        run_id: str | None = None,
        config: str | None = None,
        settings: Sequence[str] = (),
        environment: Sequence[str] = (),
    ) -> str:
        """The exact line a new peer pastes to join this swarm.

        ``settings`` are flags (``--target-batch-size 1024``) and ``environment`` ``SWARM_<FIELD>=value``
        words for the shared settings that this peer set apart from its config file (see
        :func:`swarm.net.fingerprint.shared_overrides`): without them, a newcomer would be refused as a
        mismatch. A client-mode node cannot be dialled, so its line names the initial peer it joined through.
        """
        addrs = [a for a in visible_maddrs(self.dht) if "/tcp/" in a] or visible_maddrs(self.dht)
        if self.client_mode and self.dht.initial_peers:
            addrs = [str(a) for a in self.dht.initial_peers]
        line = join_line(addrs[0]) if addrs else "swarm-peer join"
        if config:
            line += f" --config {config}"
        if run_id:
            line += f" --run-id {run_id}"
        if settings:
            line += " " + " ".join(shlex.quote(word) for word in settings)
        if environment:
            line = " ".join(shlex.quote(word) for word in environment) + " " + line
        if self.invite is not None:
            line += " --invite <the invite file you were sent>"
        return line

    def stop(self, network_alive: bool | None = None) -> None:
        """Stop the member record's renewal, the revocation watcher and the DHT with its p2p daemon; if the
        daemon already died (``network_alive`` False, or found so), terminate the DHT quietly. Idempotent."""
        from swarm.patches import rpc_guard

        self.stopping.set()
        if self.members is not None:
            self.members.stop()
        if self.revocations is not None:
            self.revocations.stop()
        rpc_guard.unguard(self.dht)
        if not self.dht.is_alive():  # it died: its p2p daemon, now nobody's child, is still running
            _stop_daemons(self.daemons)
            for path in self.daemon_sockets:  # what hivemind's P2P does when it stops its daemon itself
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            return
        if network_alive is None:
            network_alive = p2p_daemon_alive()
        if network_alive:
            self.dht.shutdown()
        else:
            self.dht.terminate()
            self.dht.join(5)

    def __enter__(self) -> SwarmNode:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_node(
    cfg: SwarmConfig,
    record_validators: Sequence = (),
    invite: Invite | None = None,
    check_reach: bool = False,
) -> SwarmNode:
    """Start this process's DHT node (and its p2p daemon) and connect it to ``cfg.initial_peers``.

    Raises SwarmConnectionError with advice when the initial peers cannot be reached within
    ``cfg.bootstrap_timeout`` seconds. With an invite (``invite``, else the file ``cfg.invite``) the DHT
    admits only peers with an invite of the same owner (swarm/net/authorizer.py) and watches the owner's
    revocations. A node that is not in client mode answers other peers' dial-back checks
    (swarm/net/reach.py). With ``check_reach`` (training peers and the monitor) and ``cfg.auto_client_mode``,
    a node that no peer can dial is restarted in client mode, with a warning that says why.
    """
    check_addresses(cfg, read_invite=False)
    if invite is None and cfg.invite:
        invite = load_invite(cfg.invite, cfg.run_id)
    node = _start(cfg, record_validators, invite)
    if not (check_reach and cfg.auto_client_mode and not cfg.client_mode and cfg.initial_peers):
        return node
    try:
        verdict = reachability.check(node.dht)
    except Exception as exc:  # the check is advice: a failure to run it must not stop the peer
        log.info("Could not check whether other peers can dial this one: %s", exc)
        return node
    node.reach = verdict
    if not verdict.unreachable:
        log.info("Reachability: %s (%.1f s)", verdict.describe(), verdict.seconds)
        return node
    log.warning(
        "No peer could dial this machine (%s; %s): switching to client mode. This peer still trains and "
        "averages through the peers it can dial. To serve others too, open the TCP port and pass "
        "--announce-maddr /ip4/<public ip>/tcp/<port>; --client-mode skips this check",
        verdict.describe(),
        "; ".join(sorted(set(verdict.why_not))) or "no reason given",
    )
    node.stop()
    node = _start(replace(cfg, client_mode=True), record_validators, invite, restarted=True)
    node.reach = verdict
    return node


def _start(
    cfg: SwarmConfig, record_validators: Sequence, invite: Invite | None, restarted: bool = False
) -> SwarmNode:
    lean_daemon_env()
    kwargs = dict(
        initial_peers=list(cfg.initial_peers),
        host_maddrs=list(cfg.host_maddrs),
        client_mode=cfg.client_mode,
        record_validators=list(record_validators),
        identity_path=cfg.identity_path,
        startup_timeout=cfg.bootstrap_timeout,
        bootstrap_timeout=cfg.bootstrap_timeout,
        wait_timeout=min(cfg.bootstrap_timeout, 5.0),
        # hivemind validates a bootstrap by asking the initial peer to ping this node back
        # (dht/protocol.py:118-122, 153-154). A client-mode node serves no ping, so the initial peer answers
        # only when its own ping back times out: after wait_timeout, just when this node's ping gives up.
        # So a client-mode node bootstraps without validation, and _bootstrapped checks that it worked.
        ensure_bootstrap_success=not cfg.client_mode,
        use_relay=cfg.use_relay,
        start=True,
    )
    if restarted:
        # the same identity was in the swarm a moment ago: hivemind's "identity taken" probe would see it
        kwargs.update(check_if_identity_free=False, use_auto_relay=cfg.use_auto_relay and cfg.use_relay)
    if cfg.announce_maddrs:
        kwargs["announce_maddrs"] = list(cfg.announce_maddrs)
    if invite is not None:
        kwargs["authorizer"] = InviteAuthorizer(invite)
    try:
        node = SwarmNode(SwarmDHT(**kwargs), invite=invite)
        if invite is not None:
            node.revocations = RevocationWatcher(node.dht, invite)
            node.revocations.start()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if cfg.initial_peers:
            raise _unreachable_initial_peers(cfg, invite, first) from None
        raise SwarmConnectionError(
            f"could not start the p2p node on {', '.join(cfg.host_maddrs)} ({first}). Check that the port is "
            "free and the identity file is readable"
        ) from None
    node.daemons = p2p_daemons(node.dht.pid)
    node.daemon_sockets = [path for path in map(control_socket, node.daemons) if path]
    if not cfg.client_mode:
        node.dht.run_coroutine(reachability.serve)
    elif cfg.initial_peers and not node.dht.run_coroutine(_bootstrapped):
        node.stop()
        raise _unreachable_initial_peers(cfg, invite, "none of them answered a ping")
    return node


def _stop_daemons(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM the p2p daemons ``pids`` that are still p2p daemons (a PID may have been reused), and wait up
    to ``grace`` seconds for them to exit (SIGKILL after), so that their socket files can be removed."""

    def signal_all(sig: int) -> list[int]:
        signalled = []
        for pid in pids:
            if is_p2p_daemon(pid) and running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    signalled.append(pid)
        return signalled

    left = signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if is_p2p_daemon(pid) and running(pid)]
    if left:
        signal_all(signal.SIGKILL)


async def _bootstrapped(_dht: hivemind.DHT, node: Any) -> bool:
    """Whether this node knows any peer (runs in the DHT process)."""
    return len(node.protocol.routing_table.peer_id_to_uid) > 0


def _unreachable_initial_peers(cfg: SwarmConfig, invite: Invite | None, why: str) -> SwarmConnectionError:
    return SwarmConnectionError(
        f"could not reach the initial peers {', '.join(cfg.initial_peers)} ({why}). Check the "
        "address and port, that the first peer is still running, that its firewall or security group "
        "allows the TCP port, and use --client-mode if this machine is behind NAT. "
        + (
            "The swarm also refuses an invite of another run or owner, and an expired or revoked one"
            if invite is not None
            else "If the swarm is invite-only, pass the invite file you were sent with --invite"
        )
    )


def visible_maddrs(dht: hivemind.DHT, allow_loopback: bool | None = None) -> list[str]:
    """Addresses that other peers can dial; loopback ones only if nothing else is announced."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]

    def is_loopback(maddr: str) -> bool:
        parts = maddr.split("/")
        try:
            return ipaddress.ip_address(parts[2]).is_loopback
        except (IndexError, ValueError):
            return False

    public = [a for a in addrs if not is_loopback(a)]
    if allow_loopback or not public:
        return addrs
    return public
