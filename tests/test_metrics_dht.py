"""The signed, schema-validated metrics record on two real DHT nodes on 127.0.0.1."""

from __future__ import annotations

import time

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import SwarmConfig
from swarm.net import metrics
from swarm.net.node import start_node
from swarm.procs import remove_stale_sockets
from swarm.waiting import wait_until

RUN_ID = "pytest-metrics"


def _record(**overrides) -> metrics.LocalMetrics:
    values = {
        "peer_name": "p",
        "global_epoch": 3,
        "samples_per_second": 10.0,
        "loss": 2.3,
        "samples_accumulated": 64,
        "mini_steps": 2,
        "time": get_dht_time(),
    }
    return metrics.LocalMetrics(**{**values, **overrides})


@pytest.fixture
def two_nodes():
    started = time.time()
    local = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=RUN_ID)
    validators, key_a = metrics.make_validators(RUN_ID)
    node_a = start_node(local, validators)
    address = node_a.join_command().split("--initial-peers ")[1].split()[0]
    # node B signs with its own key, as a separate machine would
    validators_b, key_b = metrics.make_validators(RUN_ID, RSAPrivateKey())
    node_b = start_node(
        SwarmConfig(host_maddrs=local.host_maddrs, initial_peers=(address,), run_id=RUN_ID),
        validators_b,
    )
    try:
        yield node_a.dht, key_a, node_b.dht, key_b
    finally:
        node_b.stop()
        node_a.stop()
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)


def test_signed_records_are_exchanged_and_bad_ones_rejected(two_nodes):
    a, key_a, b, key_b = two_nodes
    assert metrics.publish(a, RUN_ID, key_a, _record(peer_name="a"), expiration=30).result(timeout=10)
    assert metrics.publish(b, RUN_ID, key_b, _record(peer_name="b", global_epoch=4), expiration=30).result(10)
    seen = metrics.fetch(b, RUN_ID)
    assert {r.peer_name for r in seen.values()} == {"a", "b"}

    # malformed: wrong types never enter the DHT
    bad = dict(_record(peer_name="x").dict(), global_epoch="three")
    stored = b.store(
        metrics.metrics_key(RUN_ID), subkey=key_b, value=bad, expiration_time=get_dht_time() + 30
    )
    assert not stored
    # forged: B writes under A's key; without A's signature it is refused
    forged = _record(peer_name="forged", loss=0.0).dict()
    stored = b.store(
        metrics.metrics_key(RUN_ID), subkey=key_a, value=forged, expiration_time=get_dht_time() + 30
    )
    assert not stored
    seen = metrics.fetch(a, RUN_ID)
    assert {r.peer_name for r in seen.values()} == {"a", "b"}
    assert all(r.global_epoch in (3, 4) for r in seen.values())


def test_config_fingerprint_refuses_a_mismatch_and_ignores_forged_records(two_nodes):
    from swarm.config import build_config, replace
    from swarm.net.fingerprint import (
        MONITOR_FIELDS,
        ConfigMismatchError,
        ConfigPublisher,
        check_against_swarm,
        make_record,
    )

    a, key_a, b, key_b = two_nodes
    cfg = build_config("demo", {"run_id": RUN_ID}, environ={})
    assert check_against_swarm(b, cfg) == 0  # the first peer has nothing to compare with
    publisher = ConfigPublisher(a, cfg, key_a, "a")
    publisher.maybe_publish()
    wait_until(lambda: check_against_swarm(b, cfg) != 0, timeout=10)
    assert check_against_swarm(b, cfg) == 1  # same settings: allowed

    other = replace(cfg, num_classes=100, model_name="vit_small_patch16_224", batch_size=8)
    with pytest.raises(ConfigMismatchError) as err:
        check_against_swarm(b, other)
    text = str(err.value)
    assert "model.num_classes: swarm 10, here 100" in text and "model.model_name" in text
    assert "batch_size" not in text and "\n" not in text  # per-peer settings may differ; one line
    # a monitor compares the model and data set only: another learning rate does not stop it
    assert check_against_swarm(b, replace(cfg, lr=0.5), only=MONITOR_FIELDS) == 1
    with pytest.raises(ConfigMismatchError, match="train.lr"):
        check_against_swarm(b, replace(cfg, lr=0.5))

    # forged (B writes under A's key) and malformed records never enter the DHT
    forged = make_record(other, "forged").dict()
    key = metrics.config_key(RUN_ID)
    assert not b.store(key, subkey=key_a, value=forged, expiration_time=get_dht_time() + 30)
    assert not b.store(key, subkey=key_b, value={"fingerprint": 7}, expiration_time=get_dht_time() + 30)
    assert check_against_swarm(b, cfg) == 1


def test_a_record_that_passed_is_not_checked_again_and_a_changed_one_is():
    """The DHT validates every record of every node's answer to every read; the chain remembers the records
    that passed (by their bytes), so each is parsed and its signature checked once. A record that differs
    in any byte (value, expiration, sender) is checked again, and a forged one still fails."""
    import dataclasses

    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    (chain,), public_key = metrics.make_validators(RUN_ID, RSAPrivateKey())
    checked: list = []
    inner = chain.inner.validate
    chain.inner.validate = lambda record: checked.append(record) or inner(record)

    def signed(record: metrics.LocalMetrics, expiration: float) -> DHTRecord:
        unsigned = DHTRecord(
            key=DHTID.generate(source=metrics.metrics_key(RUN_ID)).to_bytes(),
            subkey=MSGPackSerializer.dumps(public_key),
            value=MSGPackSerializer.dumps(record.dict()),
            expiration_time=expiration,
        )
        return dataclasses.replace(unsigned, value=chain.sign_value(unsigned))

    expiration = get_dht_time() + 30
    record = signed(_record(), expiration)
    assert all(chain.validate(record) for _ in range(5))
    assert len(checked) == 1

    # the signature covers the expiration: the same value stored to expire later is a new record
    later = dataclasses.replace(record, expiration_time=expiration + 1)
    assert not chain.validate(later) and len(checked) == 2
    # a value changed after signing fails, and keeps failing
    forged = dataclasses.replace(record, value=record.value.replace(b"\xa1p", b"\xa1q"))
    assert forged.value != record.value
    assert not chain.validate(forged) and not chain.validate(forged) and len(checked) == 4
    # a validator merged in later (hivemind.Optimizer adds its own) judges the records that passed before
    from hivemind.dht.schema import SchemaValidator
    from hivemind.optim.progress_tracker import TrainingProgressSchema

    chain.merge_with(SchemaValidator(TrainingProgressSchema, prefix=RUN_ID))
    assert chain.validate(record) and len(checked) == 5


def test_a_peer_lingers_until_the_monitor_has_read_every_peers_final_metrics(two_nodes):
    """A peer at its final epoch shares its state until a monitor holds that epoch *and* has read every
    peer's metrics of it: the records live mostly on the peers' own DHT nodes, so a monitor that evaluated
    the final state before its next poll lost the last epochs' metrics when the peers left."""
    from peer.volunteer import linger_over

    a, key_a, b, key_b = two_nodes
    final = 7
    assert metrics.publish(
        a, RUN_ID, key_a, _record(peer_name="a", global_epoch=final), expiration=30
    ).result(10)
    assert metrics.publish(
        b, RUN_ID, key_b, _record(peer_name="b", global_epoch=final), expiration=30
    ).result(10)
    # no monitor: the records must also say final
    assert linger_over(a, RUN_ID, final, timeout=5) is None
    # a monitor that evaluated the final epoch but read the peers' metrics only up to the one before
    assert metrics.publish_monitor(b, RUN_ID, key_b, final, final - 1, expiration=30).result(10)
    assert wait_until(lambda: metrics.fetch_monitors(a, RUN_ID, timeout=5), timeout=10)
    assert metrics.fetch_monitors(a, RUN_ID)[0].filed_epoch == final - 1
    assert linger_over(a, RUN_ID, final, timeout=5) is None
    # it read them: the peer may leave
    assert metrics.publish_monitor(b, RUN_ID, key_b, final, final, expiration=30).result(10)
    reason = wait_until(lambda: linger_over(a, RUN_ID, final, timeout=5), timeout=10)
    assert reason == f"The monitor holds global epoch {final} and every peer is done; leaving now"
    # a monitor of an older release says nothing of the metrics it read: its evaluation is enough
    old = metrics.MonitorRecord(saved_epoch=final, time=get_dht_time())
    assert old.filed_epoch is None and old.holds(final) and not old.holds(final + 1)


def test_bans_that_other_peers_publish_are_noted_unless_the_publisher_is_banned_here(two_nodes):
    """A peer reads the bans in the others' records (swarm/suspects.py ``note_published_bans``): another
    peer's ban counts here as half the evidence, never as a ban. Its own record, a ban of itself and a
    publisher's ban of itself are skipped, and so is every ban published by a peer that it bans."""
    from swarm import suspects

    a, key_a, b, key_b = two_nodes
    own, other = a.peer_id.to_base58(), b.peer_id.to_base58()
    mine = _record(peer_name="a", peer_id=own, banned=["QmOwnBan"])
    theirs = _record(peer_name="b", peer_id=other, banned=["QmTheirBan", own, other])
    assert metrics.publish(a, RUN_ID, key_a, mine, expiration=30).result(timeout=10)
    assert metrics.publish(b, RUN_ID, key_b, theirs, expiration=30).result(timeout=10)
    assert wait_until(lambda: len(metrics.fetch(a, RUN_ID)) == 2, timeout=10), metrics.fetch(a, RUN_ID)
    records = metrics.fetch(a, RUN_ID)

    table = suspects.Suspects()
    assert suspects.note_published_bans(table, records.values(), own) == ["QmTheirBan"]
    noted = table.get("QmTheirBan")
    assert noted.seen_banned and noted.banned_for == 0 and noted.rounds == 0, noted
    assert table.get("QmOwnBan") is None and table.get(own) is None and table.get(other) is None
    # once this peer bans B, B's word counts for nothing here
    table = suspects.Suspects()
    for _ in range(suspects.MIN_JUDGED):
        table.record(other, 0.0)
    assert table.banned_for(other) > 0
    assert suspects.note_published_bans(table, records.values(), own) == []
    assert table.get("QmTheirBan") is None


def test_published_bans_of_made_up_peers_never_push_a_judged_peer_out_of_the_table():
    """The table has SLOTS places. Bans of PeerIDs this peer never judged take free places only: a record
    full of made-up PeerIDs cannot push out a groupmate's run of unrelated rounds (an attacker resetting its
    own count), and once the table is full they are not noted."""
    from types import SimpleNamespace

    from swarm import suspects

    table = suspects.Suspects()
    for i in range(suspects.SLOTS - 1):
        table.noted_direction(f"judged{i}", 0.0, z=0.5, size=4096)  # one unrelated round each
    made_up = [f"made-up{i}" for i in range(16)]
    record = SimpleNamespace(peer_id="publisher", banned=made_up)
    assert suspects.note_published_bans(table, [record], own="me") == ["made-up0"]  # one free place
    assert table.get("made-up0").seen_banned and table.get("made-up1") is None
    assert all(table.get(f"judged{i}") is not None for i in range(suspects.SLOTS - 1))
    # a peer this peer judges is marked in its own place
    record = SimpleNamespace(peer_id="publisher", banned=["judged7"])
    assert suspects.note_published_bans(table, [record], own="me") == ["judged7"]
    assert table.get("judged7").seen_banned
