"""The only module that creates a hivemind.DHT: addresses, identity, client mode and the join line.

Every role (training peer, bootstrap, monitor) joins the swarm through :func:`start_dht`, so address
checks, the signed-record validators and the error messages for unreachable peers live in one place.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

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
    cfg: SwarmConfig, record_validators: Sequence = (), invite: Invite | None = None
) -> hivemind.DHT:
    """Start this process's DHT node (and its p2p daemon) and connect it to ``cfg.initial_peers``.

    Raises SwarmConnectionError with advice when the initial peers cannot be reached within
    ``cfg.bootstrap_timeout`` seconds. With an invite (``invite``, else ``cfg.invite``) the DHT admits only
    peers with an invite of the same owner (swarm/fence.py) and watches the owner's revocations.
    Call ``stop_dht(dht)`` when done; it stops the daemon too.
    """
    check_addresses(cfg)
    if invite is None and cfg.invite:
        invite = load_invite(cfg.invite, cfg.run_id)
    kwargs = dict(
        initial_peers=list(cfg.initial_peers),
        host_maddrs=list(cfg.host_maddrs),
        client_mode=cfg.client_mode,
        record_validators=list(record_validators),
        identity_path=cfg.identity_path,
        startup_timeout=cfg.bootstrap_timeout,
        bootstrap_timeout=cfg.bootstrap_timeout,
        wait_timeout=min(cfg.bootstrap_timeout, 5.0),
        ensure_bootstrap_success=True,
        start=True,
    )
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
        return dht
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if cfg.initial_peers:
            raise SwarmConnectionError(
                f"could not reach the initial peers {', '.join(cfg.initial_peers)} ({first}). Check the "
                "address and port, that the first peer is still running, that its firewall or security group "
                "allows the TCP port, and use --client-mode if this machine is behind NAT. "
                + (
                    "The swarm also refuses an invite of another run or owner, and an expired or revoked one"
                    if invite is not None
                    else "If the swarm is invite-only, pass the invite file you were sent with --invite"
                )
            ) from None
        raise SwarmConnectionError(
            f"could not start the p2p node on {', '.join(cfg.host_maddrs)} ({first}). Check that the port is "
            "free and the identity file is readable"
        ) from None


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


def join_command(dht: hivemind.DHT, run_id: str | None = None, config: str | None = None) -> str:
    """The exact line a new peer pastes to join this swarm."""
    addrs = [a for a in visible_maddrs(dht) if "/tcp/" in a] or visible_maddrs(dht)
    line = join_line(addrs[0]) if addrs else "swarm-peer join"
    if config:
        line += f" --config {config}"
    if run_id:
        line += f" --run-id {run_id}"
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
