"""The swarm's config fingerprint: a newcomer whose model or schedule differs from the swarm's is refused
before it can average anything into the swarm.

Every training peer publishes a signed :class:`swarm.net.metrics.ConfigRecord` under ``f"{run_id}_config"``:
a hash of the settings that all peers of a run must share (the model's shape, the data set, the target
batch and the optimizer schedule) and those settings in plain text. A peer reads the records of the live
peers right after its DHT starts, before it builds ``hivemind.Optimizer`` (whose averagers are what
exchange tensors); if any differs, it stops with one line naming each differing setting. Per-peer
settings (batch size, precision, device, timeouts) may differ and are not part of the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from swarm.net.metrics import ConfigRecord, config_key, subkey_entries

if TYPE_CHECKING:
    import hivemind

    from swarm.config import ExperimentConfig
    from swarm.net.node import SwarmNode

log = logging.getLogger(__name__)

# settings every peer of a run must share: the model's tensors, the classes, the optimizer's schedule
SHARED_FIELDS = {
    "model": ("model_name", "num_classes", "img_size", "patch_size", "embed_dim", "depth", "num_heads"),
    "data": ("dataset",),
    "swarm": (
        "target_batch_size",
        "averaging",
        "aggregation",
        "compression",
        "outer_lr",
        "outer_momentum",
        "round_seconds",
    ),
    "train": ("lr", "weight_decay", "warmup_epochs", "schedule_epochs"),
}
# what a monitor needs to match: it evaluates the swarm's model on its own copy of the data
MONITOR_FIELDS = tuple(f"model.{name}" for name in SHARED_FIELDS["model"]) + (
    "data.dataset",
    "swarm.averaging",
)


def shared_overrides(cfg: ExperimentConfig, config_name: str | None) -> dict[str, str]:
    """``field`` -> value of the shared settings in which ``cfg`` differs from the config file it names (or
    the defaults): what flags or the environment changed, and a newcomer's join line must repeat."""
    from swarm.config import build_config

    base = shared_settings(build_config(config_name, environ={}), weights=False)
    mine = shared_settings(cfg, weights=False)
    return {key.split(".", 1)[1]: value for key, value in mine.items() if base[key] != value}


def join_line_for(node: SwarmNode, cfg: ExperimentConfig, config_name: str | None) -> str:
    """The join line of this node, with the shared settings it changed from its config file repeated."""
    from swarm.layout import join_words

    settings, environment = join_words(shared_overrides(cfg, config_name))
    return node.join_command(cfg.swarm.run_id, config_name, settings, environment)


class ConfigMismatchError(RuntimeError):
    """This peer's settings differ from the swarm's; the message names each difference and the fix."""


def shared_settings(cfg: ExperimentConfig, weights: bool = True) -> dict[str, str]:
    """``section.field`` -> value (as text) of the settings every peer must share, and, for a model that
    starts from pretrained weights, ``model.weights``: their hash (``weights=False`` leaves it out, since
    it may build the model; random weights leave it out too, as peers before it did)."""
    from swarm.training.model import uses_pretrained, weights_id

    fields = {
        f"{section}.{name}": str(getattr(getattr(cfg, section), name))
        for section, names in SHARED_FIELDS.items()
        for name in names
    }
    if weights and uses_pretrained(cfg.model):
        fields["model.weights"] = weights_id(cfg.model)
    return fields


def fingerprint(fields: dict[str, str]) -> str:
    """A short stable hash of ``fields``."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def make_record(cfg: ExperimentConfig, peer_name: str) -> ConfigRecord:
    fields = shared_settings(cfg)
    return ConfigRecord(fingerprint=fingerprint(fields), fields=fields, peer_name=peer_name[:64])


def fetch_records(
    dht: hivemind.DHT, run_id: str, timeout: float = 10.0, warned: set | None = None
) -> list[ConfigRecord]:
    """The live peers' config records; malformed ones are skipped (the validators dropped forgeries), with
    one warning per subkey in ``warned`` (a caller that polls passes the same set every time)."""
    warned = set() if warned is None else warned
    records = []
    for subkey, entry in subkey_entries(dht, config_key(run_id), timeout).items():
        try:
            records.append(ConfigRecord.parse_obj(entry.value))
        except Exception as exc:  # a buggy or hostile record must not decide whether we may join
            if subkey not in warned:
                warned.add(subkey)
                log.warning("Ignoring a malformed config record: %s", str(exc).splitlines()[0])
    return records


def differences(
    ours: dict[str, str], theirs: dict[str, str], only: tuple[str, ...] | None = None
) -> list[str]:
    """``name: swarm X, here Y`` for every shared setting that differs (restricted to ``only`` if given)."""
    names = sorted(set(ours) | set(theirs))
    if only is not None:
        names = [n for n in names if n in only]
    return [
        f"{n}: swarm {theirs.get(n, 'unset')}, here {ours.get(n, 'unset')}"
        for n in names
        if ours.get(n) != theirs.get(n)
    ]


def check_against_swarm(
    dht: hivemind.DHT, cfg: ExperimentConfig, only: tuple[str, ...] | None = None, timeout: float = 10.0
) -> int:
    """Raise ConfigMismatchError if a live peer of the run publishes other shared settings than ``cfg``.

    ``only`` restricts the comparison (the monitor compares the model and data set). Returns how many
    peers' records were compared (0 when this peer is the first).
    """
    ours = shared_settings(cfg, weights=only is None or "model.weights" in only)
    try:
        records = fetch_records(dht, cfg.swarm.run_id, timeout)
    except TimeoutError:
        log.warning("Could not read the swarm's config within %.0f s; joining without the check", timeout)
        return 0
    for record in records:
        diff = differences(ours, record.fields, only)
        if diff:
            raise ConfigMismatchError(
                f"this peer's settings do not match the swarm {cfg.swarm.run_id!r} "
                f"(peer {record.peer_name}): "
                + "; ".join(diff)
                + ". Use the swarm's settings (its --config), or another --run-id to start a separate swarm"
            )
    if records:
        log.info("Config matches the swarm's (%d peers' fingerprints compared)", len(records))
    return len(records)


def wait_for_peers(
    publisher: ConfigPublisher, count: int, stop: Any, poll: float = 0.5, say_every: float = 15.0
) -> int:
    """Wait until ``count`` training peers of the run are ready for their first step (their config records
    say so; this one's too, once ``publisher`` has stored it, and it keeps it alive meanwhile), or ``stop``
    (an Event) is set; returns how many were seen."""
    dht, run_id = publisher.dht, publisher.run_id
    seen, said, warned = 0, -float("inf"), set()
    while not stop.is_set():
        publisher.maybe_publish()
        try:
            seen = sum(record.ready for record in fetch_records(dht, run_id, warned=warned))
        except TimeoutError:
            seen = 0
        if seen >= count:
            break
        if time.monotonic() - said >= say_every:
            said = time.monotonic()
            log.info(
                "Waiting for %d training peer(s) of run %r before the first step (--min-peers %d); %d "
                "so far, this one included",
                count - seen,
                run_id,
                count,
                seen,
            )
        stop.wait(poll)
    return seen


class ConfigPublisher:
    """Keeps this peer's config record alive in the DHT: stores it now and again every ``every`` seconds."""

    def __init__(self, dht: hivemind.DHT, cfg: ExperimentConfig, public_key: bytes, peer_name: str) -> None:
        self.dht, self.run_id, self.public_key = dht, cfg.swarm.run_id, public_key
        self.key = config_key(self.run_id)
        self.record = make_record(cfg, peer_name)
        # short-lived, so that a swarm restarted with new settings is not refused by its predecessor for long
        self.every = cfg.swarm.metrics_expiration / 2
        self.expiration = 1.5 * cfg.swarm.metrics_expiration
        self.next_at = 0.0

    def mark_ready(self) -> None:
        """From now on the record says that this peer is ready for its first step; stored at once."""
        self.record = self.record.copy(update={"ready": True})
        self.next_at = 0.0
        self.maybe_publish()

    def maybe_publish(self) -> None:
        """Store the record if it is due (cheap to call after every local step)."""
        if time.monotonic() < self.next_at:
            return
        from hivemind.utils import get_dht_time

        self.next_at = time.monotonic() + self.every
        try:
            self.dht.store(
                key=self.key,
                subkey=self.public_key,
                value=self.record.dict(),
                expiration_time=get_dht_time() + self.expiration,
                return_future=True,
            )
        except Exception as exc:  # best effort, as metrics are; the next call tries again
            log.warning("Could not publish this peer's config fingerprint: %s", exc)
