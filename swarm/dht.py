"""The only module that creates a hivemind.DHT: addresses, identity, client mode and the join line.

Every role (training peer, bootstrap, monitor) joins the swarm through :func:`start_dht`, so address
checks, the signed-record validators and the error messages for unreachable peers live in one place.
"""

from __future__ import annotations

import ipaddress
import logging
import shlex
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

from swarm import reach
from swarm.authorizer import InviteAuthorizer, RevocationWatcher
from swarm.config import SwarmConfig
from swarm.invite import Invite, load_invite
from swarm.layout import join_line

log = logging.getLogger(__name__)


class _RequestPipe:
    """The DHT process's end of its request pipe, tolerant of senders that exit mid-request.

    Every request carries the pipe for its reply, handed over through the *sender's* resource-sharer
    thread. If the sender (an averager process at shutdown) exits between sending and our read, unpickling
    raises EOFError, which hivemind does not catch (the DHT process died with a traceback), or a
    ConnectionError, which hivemind logs with a traceback before sleeping 3 s. Such a request has no one
    waiting for its answer, so it is skipped.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def recv(self) -> Any:
        data = self._conn.recv_bytes()  # EOFError here means our own pipe closed: let hivemind see it
        try:
            return ForkingPickler.loads(data)
        except (EOFError, OSError):  # reset, refused or closed: the sender's resource sharer is gone
            log.debug("Skipped a DHT request whose sender exited before it was read")
            return ("_skip_request", [], {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class SwarmDHT(hivemind.DHT):
    """hivemind.DHT whose background process survives requests from processes that exited meanwhile."""

    def run(self) -> None:
        self._inner_pipe = _RequestPipe(self._inner_pipe)
        super().run()

    async def _skip_request(self) -> None:
        return None


class SwarmConnectionError(RuntimeError):
    """This peer could not start or reach the swarm; the message says what to check."""


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


def check_addresses(cfg: SwarmConfig) -> None:
    """Validate every multiaddr of ``cfg`` and its invite before any slow work; raises ValueError (or
    InviteError, one of them) naming the option."""
    check_multiaddrs(cfg.initial_peers, "--initial-peers", need_peer_id=True)
    check_multiaddrs(cfg.host_maddrs, "--host-maddr")
    check_multiaddrs(cfg.announce_maddrs, "--announce-maddr")
    if cfg.invite:
        load_invite(cfg.invite, cfg.run_id)


def start_dht(
    cfg: SwarmConfig,
    record_validators: Sequence = (),
    invite: Invite | None = None,
    check_reach: bool = False,
) -> hivemind.DHT:
    """Start this process's DHT node (and its p2p daemon) and connect it to ``cfg.initial_peers``.

    Raises SwarmConnectionError with advice when the initial peers cannot be reached within
    ``cfg.bootstrap_timeout`` seconds. With an invite (``invite``, else ``cfg.invite``) the DHT admits only
    peers with an invite of the same owner (swarm/fence.py) and watches the owner's revocations.
    A node that is not in client mode answers other peers' dial-back checks (swarm/reach.py). With
    ``check_reach`` (training peers and the monitor) and ``cfg.auto_client_mode``, a node that no peer can
    dial is restarted in client mode, with a warning that says why; ``dht.client_mode`` tells which it is, and
    ``dht.swarm_reach`` holds the check's :class:`swarm.reach.Verdict` (None if not checked).
    Call ``stop_dht(dht)`` when done; it stops the daemon too.
    """
    check_addresses(cfg)
    if invite is None and cfg.invite:
        invite = load_invite(cfg.invite, cfg.run_id)
    dht = _start_dht(cfg, record_validators, invite)
    dht.swarm_reach = None
    if not (check_reach and cfg.auto_client_mode and not cfg.client_mode and cfg.initial_peers):
        return dht
    try:
        verdict = reach.check(dht)
    except Exception as exc:  # the check is advice: a failure to run it must not stop the peer
        log.info("Could not check whether other peers can dial this one: %s", exc)
        return dht
    dht.swarm_reach = verdict
    if not verdict.unreachable:
        log.info("Reachability: %s", verdict.describe())
        return dht
    log.warning(
        "No peer could dial this machine (%s; %s): switching to client mode. This peer still trains and "
        "averages through the peers it can dial. To serve others too, open the TCP port and pass "
        "--announce-maddr /ip4/<public ip>/tcp/<port>; --client-mode skips this check",
        verdict.describe(),
        "; ".join(sorted(set(verdict.why_not))) or "no reason given",
    )
    stop_dht(dht)
    dht = _start_dht(replace(cfg, client_mode=True), record_validators, invite, restarted=True)
    dht.swarm_reach = verdict
    return dht


def _start_dht(
    cfg: SwarmConfig, record_validators: Sequence, invite: Invite | None, restarted: bool = False
) -> hivemind.DHT:
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
        dht = SwarmDHT(**kwargs)
        dht.swarm_invite = invite  # swarm.fence.attach fences the averagers built on this DHT
        if invite is not None:
            dht.swarm_revocations = RevocationWatcher(dht, invite)
            dht.swarm_revocations.start()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if cfg.initial_peers:
            raise _unreachable_initial_peers(cfg, invite, first) from None
        raise SwarmConnectionError(
            f"could not start the p2p node on {', '.join(cfg.host_maddrs)} ({first}). Check that the port is "
            "free and the identity file is readable"
        ) from None
    if not cfg.client_mode:
        dht.run_coroutine(reach.serve)
    elif cfg.initial_peers and not dht.run_coroutine(_bootstrapped):
        stop_dht(dht)
        raise _unreachable_initial_peers(cfg, invite, "none of them answered a ping")
    return dht


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


def join_command(
    dht: hivemind.DHT,
    run_id: str | None = None,
    config: str | None = None,
    settings: Sequence[str] = (),
    environment: Sequence[str] = (),
) -> str:
    """The exact line a new peer pastes to join this swarm.

    ``settings`` are flags (``--target-batch-size 1024``) and ``environment`` ``SWARM_<FIELD>=value`` words
    for the shared settings that this peer set apart from its config file (see
    :func:`swarm.fingerprint.shared_overrides`): without them, a newcomer would be refused as a mismatch.
    A client-mode node cannot be dialled, so its line names the initial peer it joined through instead.
    """
    addrs = [a for a in visible_maddrs(dht) if "/tcp/" in a] or visible_maddrs(dht)
    if getattr(dht, "client_mode", False) and dht.initial_peers:
        addrs = [str(a) for a in dht.initial_peers]
    line = join_line(addrs[0]) if addrs else "swarm-peer join"
    if config:
        line += f" --config {config}"
    if run_id:
        line += f" --run-id {run_id}"
    if settings:
        line += " " + " ".join(shlex.quote(word) for word in settings)
    if environment:
        line = " ".join(shlex.quote(word) for word in environment) + " " + line
    if getattr(dht, "swarm_invite", None) is not None:
        line += " --invite <the invite file you were sent>"
    return line


def stop_dht(dht: hivemind.DHT, network_alive: bool | None = None) -> None:
    """Shut the DHT and its p2p daemon down; if the daemon already died, terminate the DHT quietly."""
    from swarm.procs import p2p_daemon_alive

    watcher = getattr(dht, "swarm_revocations", None)
    if watcher is not None:
        watcher.stop()
    if not dht.is_alive():
        return
    if network_alive is None:
        network_alive = p2p_daemon_alive()
    if network_alive:
        dht.shutdown()
    else:
        dht.terminate()
        dht.join(5)
