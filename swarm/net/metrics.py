"""The DHT metrics record: schema (pydantic.v1, signed per peer), key names and metric tag names.

Each training peer stores one record per global epoch under ``f"{run_id}_metrics"`` with its RSA public
key as the subkey. hivemind's RSASignatureValidator signs the record, so only the owner of a key can
write its subkey, and SchemaValidator rejects records of the wrong shape before they enter the DHT.
"""

import collections
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictInt, confloat, conint, conlist, constr

if TYPE_CHECKING:
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

log = logging.getLogger(__name__)

# metric tags shared by every role and TensorBoard writer
TRAIN_LOSS, TRAIN_SPS = "train/loss", "train/samples_per_second"
TRAIN_DATA_EPOCH = "train/data_epoch"  # passes over the training set: samples in optimizer steps / images
VAL_LOSS, VAL_ACC, VAL_ACC_TOP5 = "val/loss", "val/acc", "val/acc_top5"
SWARM_PEERS, SWARM_EPOCH, SWARM_SPS = "swarm/peers", "swarm/global_epoch", "swarm/samples_per_second"
SYS_GPU_MEM, SYS_GPU_UTIL = "sys/gpu_mem_gb", "sys/gpu_util"  # per peer in the monitor: sys/gpu_util/<peer>
# the end of a round, split (swarm/averaging/rounds.py): median over the peers that reported the epoch, in
# seconds
ROUND_PARTS = ("end", "matchmaking", "allreduce", "state", "update")
ROUND_TAGS = {part: f"round/{part}_seconds" for part in ROUND_PARTS}
ROUND_LOCAL = "round/local_steps"  # peers whose gradient round failed and who stepped on their own gradient
ROUND_REJECTED = "round/rejected"  # peers whose screen refused an averaged result (swarm/averaging/screen.py)
# senders' parts that the peers' robust means scaled down (swarm/patches/robust.py), summed over the peers
ROUND_CLIPPED = "round/clipped"
ROUND_SUSPECTS = "round/suspects"  # groupmates banned by at least one peer (swarm/suspects.py)


def metrics_key(run_id: str) -> str:
    """The DHT key under which every peer of ``run_id`` publishes its metrics."""
    return f"{run_id}_metrics"


class StateSketch(BaseModel):
    """The sketch of the state a peer held at one global epoch (swarm/patches/state_averager.py
    ``state_sketch``: its norm, then 4 projections), for newcomers to check a download against."""

    epoch: conint(ge=0, strict=True)
    sketch: conlist(StrictFloat, min_items=5, max_items=5)


class LocalMetrics(BaseModel):
    """One peer's report for one global epoch. Validation fields are set when the peer evaluated."""

    peer_name: constr(max_length=64, strict=True)
    global_epoch: conint(ge=0, strict=True)
    samples_per_second: confloat(ge=0.0, strict=True)
    loss: StrictFloat
    samples_accumulated: conint(ge=0, strict=True)
    mini_steps: conint(ge=0, strict=True)
    time: StrictFloat
    val_epoch: StrictInt | None = None
    val_loss: StrictFloat | None = None
    val_acc: confloat(ge=0.0, le=1.0, strict=True) | None = None
    val_samples: conint(ge=0, strict=True) = 0
    target_batch_size: conint(ge=1, strict=True) | None = None
    round_end: confloat(ge=0.0, strict=True) | None = None
    round_matchmaking: confloat(ge=0.0, strict=True) | None = None
    round_allreduce: confloat(ge=0.0, strict=True) | None = None
    round_state: confloat(ge=0.0, strict=True) | None = None
    round_update: confloat(ge=0.0, strict=True) | None = None
    round_local: StrictBool | None = None
    # this peer's screen (swarm/averaging/screen.py) refused this epoch's averaged gradient or state; rounds
    # so far
    round_rejected: StrictBool | None = None
    rejected_rounds: conint(ge=0, strict=True) | None = None
    # senders' parts that this peer's robust mean scaled down since its last record (swarm/patches/robust.py)
    round_clipped: conint(ge=0, strict=True) | None = None
    # the PeerIDs this peer bans now (swarm/suspects.py), at most 16
    banned: conlist(constr(max_length=64, strict=True), max_items=16) | None = None
    # passes over the training set: global epochs x target batch / this peer's training images
    data_epoch: confloat(ge=0.0, strict=True) | None = None
    # this peer's GPU (NVML, swarm/training/sysmetrics.py): memory in use in GB and percent of time busy; None
    # on a CPU
    gpu_mem_gb: confloat(ge=0.0, strict=True) | None = None
    gpu_util: confloat(ge=0.0, le=100.0, strict=True) | None = None
    # this peer's PeerID (base58) and the sketches of the states it held at its last few global epochs
    # (swarm/averaging/donors.py)
    peer_id: constr(max_length=64, strict=True) | None = None
    state_sketches: conlist(StateSketch, max_items=8) | None = None
    # the peer reached max_epochs: this is its last epoch, and it shares its state until a monitor holds it
    final: StrictBool | None = None


def config_key(run_id: str) -> str:
    """The DHT key under which every training peer of ``run_id`` publishes its config fingerprint."""
    return f"{run_id}_config"


class ConfigRecord(BaseModel):
    """What a peer trains with: a fingerprint of the settings that every peer must share, and the
    settings themselves (``section.field`` -> value as text), so a mismatch can be explained."""

    fingerprint: constr(max_length=64, strict=True)
    fields: dict[constr(max_length=64, strict=True), constr(max_length=200, strict=True)]
    peer_name: constr(max_length=64, strict=True)
    ready: StrictBool = False  # its optimizer and averagers are up; its first step is next (--min-peers)


def members_key(run_id: str) -> str:
    """The DHT key under which every peer of an invite-only ``run_id`` ties its PeerID to its invite."""
    return f"{run_id}_members"


class MemberRecord(BaseModel):
    """A peer's proof that it holds an invite (swarm/net/fence.py): its PeerID (base58), the invite's
    certificate as text, and the invite key's signature over the run and the PeerID (base64)."""

    peer_id: constr(max_length=128, strict=True)
    certificate: constr(max_length=2000, strict=True)
    signature: constr(max_length=200, strict=True)


def revoked_key(run_id: str) -> str:
    """The DHT key under which the owner of an invite-only ``run_id`` publishes the invites it revoked."""
    return f"{run_id}_revoked"


def revocation_records(found) -> list[dict]:
    """The values stored under :func:`revoked_key`, from a ``dht.get(..., latest=True)`` result (maybe None);
    their signatures are checked by swarm.net.invite.revoked_names."""
    if found is None or not isinstance(found.value, dict):
        return []
    return [entry.value for entry in found.value.values() if isinstance(entry.value, dict)]


class RevocationRecord(BaseModel):
    """Names of invites the run's owner revoked, when, and the owner's signature (swarm/net/invite.py)."""

    names: list[constr(max_length=64, strict=True)]
    issued: StrictFloat
    signature: constr(max_length=200, strict=True)


def monitor_key(run_id: str) -> str:
    """The DHT key under which a monitor of ``run_id`` says which global epoch's state it holds."""
    return f"{run_id}_monitor"


class MonitorRecord(BaseModel):
    """A monitor's presence: the newest global epoch whose state it downloaded and evaluated (-1: none
    yet) and the newest epoch whose metrics records it has read from every live peer (``filed_epoch``; None
    from a monitor of an older release), renewed while it runs. A peer that reached max_epochs shares its
    final state until a monitor holds it and has read every peer's record of that epoch, and for its whole
    linger when no monitor is there (peer/volunteer.py); ``swarm-peer status`` shows it."""

    saved_epoch: conint(ge=-1, strict=True)
    time: StrictFloat
    filed_epoch: conint(ge=-1, strict=True) | None = None

    def holds(self, epoch: int) -> bool:
        """Whether this monitor evaluated ``epoch`` and read every peer's metrics of it: a peer's records
        live on the DHT nodes nearest their key, mostly the peers', and vanish when the peers leave."""
        return self.saved_epoch >= epoch and (self.filed_epoch is None or self.filed_epoch >= epoch)


def _schema():
    from hivemind.dht.schema import BytesWithPublicKey

    class MetricSchema(BaseModel):
        """DHT schema: the metrics, monitor, config, members and revoked keys map public keys (subkeys)
        to their records."""

        metrics: dict[BytesWithPublicKey, LocalMetrics]
        monitor: dict[BytesWithPublicKey, MonitorRecord]
        config: dict[BytesWithPublicKey, ConfigRecord]
        members: dict[BytesWithPublicKey, MemberRecord]
        revoked: dict[BytesWithPublicKey, RevocationRecord]

    return MetricSchema


PASSED_KEPT = 4096  # records that passed validation, remembered (AuditingValidator)


class AuditingValidator(RecordValidatorBase):
    """Applies the schema and signature validators and warns once per sender whose record it rejects.

    hivemind logs rejected records at DEBUG only, so a forged or malformed record would vanish silently.
    Validators that hivemind adds later (the optimizer's progress schema and signature) are absorbed into
    the same chain, so records are still signed exactly once.
    """

    def __init__(self, validators: list) -> None:
        self.inner = CompositeValidator(validators)
        self.warned: set[bytes] = set()
        self.passed: collections.OrderedDict[DHTRecord, None] = collections.OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        # A record is judged by its bytes alone (schema; signature over key, subkey, value, expiration),
        # and the DHT sees the same ones again and again: every node's answer to a read carries every peer's
        # record, and a record stays unchanged until its peer's next epoch. Records that passed are remembered
        # (the last PASSED_KEPT), so each is parsed and its signature checked once per process.
        if record in self.passed:
            self.passed.move_to_end(record)
            return True
        if self.inner.validate(record):
            self.passed[record] = None
            if len(self.passed) > PASSED_KEPT:
                self.passed.popitem(last=False)
            return True
        who = record.subkey if record.subkey else record.key
        if who not in self.warned:
            self.warned.add(who)
            log.warning(
                "Ignoring a DHT record that fails its signature or schema check (forged or malformed; sender "
                "key %s); further records from that key are dropped silently",
                hashlib.sha256(who).hexdigest()[:10],
            )
        return False

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.inner.strip_value(record)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        self.inner.extend([other])
        self.passed.clear()  # passed the old chain, not yet the new one
        return True


def make_validators(run_id: str, private_key: "RSAPrivateKey | None" = None) -> tuple[list, bytes]:
    """Validators for the DHT of ``run_id`` and the public key (the subkey) this process writes under.

    ``private_key`` defaults to hivemind's process-wide key, which hivemind.Optimizer signs with too.
    """
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator

    signature = RSASignatureValidator(private_key)
    chain = AuditingValidator([SchemaValidator(_schema(), prefix=run_id), signature])
    return [chain], signature.local_public_key


def publish(dht: "hivemind.DHT", run_id: str, public_key: bytes, record: LocalMetrics, expiration: float):
    """Store ``record`` under this peer's subkey without blocking training; returns the future."""
    return _store(dht, metrics_key(run_id), public_key, record, expiration)


def _store(dht: "hivemind.DHT", key: str, public_key: bytes, record: BaseModel, expiration: float) -> Any:
    """Store ``record`` under ``key`` and this process's subkey, ``expiration`` seconds from now, without
    blocking; returns the future."""
    from hivemind.utils import get_dht_time

    return dht.store(
        key=key,
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


def subkey_entries(dht: "hivemind.DHT", key: str, timeout: float = 10.0) -> dict:
    """{subkey: entry} stored under ``key`` ({} if none). Waits at most ``timeout`` seconds (raises
    TimeoutError), so a dead DHT process cannot hang the caller."""
    return _entries(dht.get(key, latest=True, return_future=True).result(timeout=timeout))


def _entries(result: Any) -> dict:
    if result is None or not isinstance(result.value, dict):
        return {}
    return result.value


def fetch(
    dht: "hivemind.DHT", run_id: str, warned: set | None = None, timeout: float = 10.0
) -> dict[bytes, LocalMetrics]:
    """Read the live records of ``run_id``. Malformed ones are skipped with one warning per subkey.

    Waits at most ``timeout`` seconds (raises TimeoutError), so a dead DHT process cannot hang the caller.
    """
    return parse_fetched(request(dht, run_id).result(timeout=timeout), warned)


def request(dht: "hivemind.DHT", run_id: str) -> Any:
    """Start reading the records of ``run_id``; returns hivemind's future, for :func:`parse_fetched`. A
    peer reads them once per global epoch, and waiting for the answer cost its training about 50 ms."""
    return dht.get(metrics_key(run_id), latest=True, return_future=True)


def parse_fetched(result: Any, warned: set | None = None) -> dict[bytes, LocalMetrics]:
    """The records in what :func:`request`'s future returned; malformed ones are skipped with one warning
    per subkey."""
    warned = set() if warned is None else warned
    out: dict[bytes, LocalMetrics] = {}
    for subkey, entry in _entries(result).items():
        try:
            out[subkey] = LocalMetrics.parse_obj(entry.value)
        except Exception as exc:  # a record from a buggy or hostile peer must not stop us
            if subkey not in warned:
                warned.add(subkey)
                log.warning("Ignoring a malformed metrics record from one peer: %s", str(exc).splitlines()[0])
    return out


def publish_monitor(
    dht: "hivemind.DHT", run_id: str, public_key: bytes, saved_epoch: int, filed_epoch: int, expiration: float
) -> Any:
    """Store this monitor's :class:`MonitorRecord` without blocking; returns the future."""
    from hivemind.utils import get_dht_time

    record = MonitorRecord(saved_epoch=saved_epoch, filed_epoch=filed_epoch, time=get_dht_time())
    return _store(dht, monitor_key(run_id), public_key, record, expiration)


def fetch_monitors(dht: "hivemind.DHT", run_id: str, timeout: float = 10.0) -> list[MonitorRecord]:
    """The live monitors' records of ``run_id`` ([] when no monitor is there); raises TimeoutError after
    ``timeout`` seconds."""
    return _parsed(subkey_entries(dht, monitor_key(run_id), timeout), MonitorRecord)


def _parsed(entries: dict, model: Any) -> list:
    """The values of ``entries`` parsed as ``model``; schema-checked by the DHT already, so a bad or empty
    one is simply skipped."""
    out = []
    for entry in entries.values():
        try:
            if entry.value is not None:
                out.append(model.parse_obj(entry.value))
        except Exception:
            continue
    return out


def progress_key(run_id: str) -> str:
    """The DHT key under which hivemind.Optimizer's progress tracker publishes each peer's progress."""
    return f"{run_id}_progress"


def fetch_progress(dht: "hivemind.DHT", run_id: str, timeout: float = 10.0) -> list:
    """hivemind's per-peer LocalTrainingProgress records (epoch, samples toward the next step, client)."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress

    return _parsed(subkey_entries(dht, progress_key(run_id), timeout), LocalTrainingProgress)
