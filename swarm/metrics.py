"""The DHT metrics record: schema (pydantic.v1, signed per peer), key names and metric tag names.

Each training peer stores one record per global epoch under ``f"{run_id}_metrics"`` with its RSA public
key as the subkey. hivemind's RSASignatureValidator signs the record, so only the owner of a key can
write its subkey, and SchemaValidator rejects records of the wrong shape before they enter the DHT.
"""

import logging
from typing import TYPE_CHECKING

from pydantic.v1 import BaseModel, StrictFloat, StrictInt, confloat, conint, constr

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)

# metric tags shared by every role and TensorBoard writer
TRAIN_LOSS, TRAIN_SPS = "train/loss", "train/samples_per_second"
VAL_LOSS, VAL_ACC, VAL_ACC_TOP5 = "val/loss", "val/acc", "val/acc_top5"
SWARM_PEERS, SWARM_EPOCH, SWARM_SPS = "swarm/peers", "swarm/global_epoch", "swarm/samples_per_second"
SYS_GPU_MEM, SYS_GPU_UTIL = "sys/gpu_mem_gb", "sys/gpu_util"


def metrics_key(run_id: str) -> str:
    """The DHT key under which every peer of ``run_id`` publishes its metrics."""
    return f"{run_id}_metrics"


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


def _schema():
    from hivemind.dht.schema import BytesWithPublicKey

    class MetricSchema(BaseModel):
        """DHT schema: the metrics key maps public keys (subkeys) to LocalMetrics."""

        metrics: dict[BytesWithPublicKey, LocalMetrics]

    return MetricSchema


def make_validators(run_id: str) -> tuple[list, bytes]:
    """Validators for the DHT of ``run_id`` and this process's public key (the subkey it writes)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator

    signature = RSASignatureValidator()
    return [SchemaValidator(_schema(), prefix=run_id), signature], signature.local_public_key


def publish(dht: "hivemind.DHT", run_id: str, public_key: bytes, record: LocalMetrics, expiration: float):
    """Store ``record`` under this peer's subkey without blocking training; returns the future."""
    from hivemind.utils import get_dht_time

    return dht.store(
        key=metrics_key(run_id),
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


def fetch(
    dht: "hivemind.DHT", run_id: str, warned: set | None = None, timeout: float = 10.0
) -> dict[bytes, LocalMetrics]:
    """Read the live records of ``run_id``. Malformed ones are skipped with one warning per subkey.

    Waits at most ``timeout`` seconds (raises TimeoutError), so a dead DHT process cannot hang the caller.
    """
    result = dht.get(metrics_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    if result is None or not isinstance(result.value, dict):
        return {}
    warned = set() if warned is None else warned
    out: dict[bytes, LocalMetrics] = {}
    for subkey, entry in result.value.items():
        try:
            out[subkey] = LocalMetrics.parse_obj(entry.value)
        except Exception as exc:  # a record from a buggy or hostile peer must not stop us
            if subkey not in warned:
                warned.add(subkey)
                log.warning("Ignoring a malformed metrics record from one peer: %s", str(exc).splitlines()[0])
    return out
