"""The all-reduce (hivemind/averaging/allreduce.py and the averager's side of it in averaging/averager.py).

**What hivemind does.** Each tensor is split into parts of its own (averaging/partition.py), and each part
costs a compression call in a thread, a message and a reply. A reducer that receives a part of a group it
has not registered waits for that group without a limit (``DecentralizedAverager.rpc_aggregate_part``,
averager.py:581-598, ``_pending_groups_registered``). A sender that fails is awaited until ``sender_timeout``
(``AllReduceRunner._communicate_with_peer``, allreduce.py:201-257).

**What goes wrong.** The demo's 50 small tensors took 0.45 s to average on loopback, one tensor of the same
numbers 0.18 s (item 3 of docs/hivemind-patches.md). Matchmaking can put a peer into a group that the peer
itself never learns of (a follower starved for longer than ``request_timeout`` gives up on its leader, which
has already accepted it): its groupmates then send it parts that it holds until their
``allreduce_timeout``, and the round fails on one side with "received 50.0% of input tensors" and on the other
with "could not find a group" (item 8). The groupmates that ran the round then go on to their state round,
while the one that never learnt of it looks for the next gradient group: each waits for the other in a
different averager (item 11).

**What this changes.** :class:`PacksParts` averages one buffer per dtype and role. The patch answers a part
of an unknown group with ``BAD_GROUP_ID`` after ``request_timeout`` of its own running time (a stall of the
averager's process does not count; a part of the group this averager assembled and whose trigger it awaits,
in a pre-scheduled round, waits as in hivemind), drops a groupmate whose reducer failed before it sent
anything, or whose parts this peer refused once it banned the groupmate in the middle of the round
(:func:`drop_sender`, called by swarm/patches/rpc_guard.py); to a groupmate it banned it still sends its own
parts, and takes nothing back (item 28); and it names those that answered ``BAD_GROUP_ID``
(strangers) in the round's result, a :class:`Gathered` (:class:`NamesStrangers`), so that the optimizer can
meet them in the next gradient round (swarm/patches/optimizer.py).

**One result for the whole group** (item 35). hivemind's reducer sends each sender the difference between the
part's average and that sender's own part, compressed (allreduce.py:353-355), and each sender adds it to
its own numbers. With a lossy compression the senders' differences are rounded differently, so the peers of
one round end it with different results: with int8 DiLoCo pseudo-gradients the 8 anchors of the volunteers
lab drifted apart by 1e-5 of their norm within 8 rounds, a state round that found them in agreement
(item 16) never came, and each ran one (17-23 s at 2 Mbit/s). An averager whose class is
:class:`EndsWithOneResult` (the gradient averager) marks the first part it sends with :data:`ONE_RESULT`; a
reducer of this package answers such a sender with the average itself, compressed once per part and
compression and sent alike to every sender that asked, and uses the same decoded numbers for its own part.
Every groupmate then holds the same numbers, to float rounding. The state averager keeps hivemind's
differences: its parameters travel as float16, which would round the weights themselves. An unmarked sender
or a reducer without the change gets or gives hivemind's differences, as before.

**Differences added to the part as sent** (item 36). hivemind's reducer computes a sender's difference from
the part as it decoded it (allreduce.py:353), and the sender added it to its numbers before compression: each
groupmate of a float16 state round ended it with the average plus its own rounding of its weights (up to
4.9e-4 at 1), and peers that had parted never agreed again. A sender keeps what it sent until the round ends
and adds the difference to that, decoded. A round in which a reducer failed or went silent is partial; the
result (:class:`Gathered`) says which share came back (``received``).

**A slice that never came back is zero** (item 38). hivemind keeps a peer's own numbers for the slice of a
reducer that failed (partition.py:128-136). When a groupmate dies in the middle of a round, every survivor
lacks its slice, and each kept its own: with DiLoCo pseudo-gradients the survivors' anchors parted by the
difference of their own phases there, and the outer momentum carried that on for some ten rounds. In the
volunteers lab under churn the peers held one state until the first peer was killed, then nearly as many
states as peers, and honest peers' val loss jumped above 1 again and again. In a round that must end with one
result such a slice comes back as zeros, alike in every survivor: that slice's step is left to the momentum,
which the survivors hold alike.
"""

from __future__ import annotations

import asyncio
import logging
from functools import cache
from typing import Any, get_type_hints

import torch

from swarm.patches._registry import Patch

log = logging.getLogger(__name__)

_STRANGERS = "_swarm_strangers"  # attribute of one round's AllReduceRunner (ours: set in our own wrapper)
_ASSEMBLED = "_swarm_assembled"  # attribute of an averager's Matchmaking: the group it assembled last
NOTED_EVERY = (
    0.02  # seconds between two looks, while a part of an unknown group waits, at what matchmaking noted
)
AWAKE_AT_MOST = 2 * NOTED_EVERY  # of one look's wall time, what counts toward request_timeout
# item 35: in ``AveragingData.peer_id``, which hivemind's all-reduce leaves unset: on a sender's first part,
# "answer me with the average"; on a reducer's answer, "this is the average, not the difference from my part"
ONE_RESULT = b"swarm:one-result"
_RESULTS = "_swarm_results"  # attribute of one round's AllReduceRunner: its serialized averages, by part
_SENT = "_swarm_sent"  # the same: the parts this peer sent, as sent, by groupmate (item 36)


class EndsWithOneResult:
    """Mixin for hivemind's averagers whose groupmates must end each round with the same numbers (item 35):
    their rounds ask for the average itself, not each sender's difference from it."""

    one_result = True


def _one_result(runner: Any) -> bool:
    return bool(getattr(runner._servicer_type, "one_result", False))


def _compression_type(compression: Any, info: Any) -> Any:
    """The wire format that ``compression`` (adaptive ones choose by the part's info) gives this part."""
    while hasattr(compression, "choose_compression"):
        compression = compression.choose_compression(info)
    return compression.compression_type


async def _serialized_average(runner: Any, part_index: int, averaged: torch.Tensor, compression: Any) -> Any:
    """The average of this reducer's part ``part_index``, serialized in ``compression`` once for all the
    senders that asked for it (and this peer's own part): one message, so one set of decoded numbers."""
    from hivemind.compression import serialize_torch_tensor

    results = runner.__dict__.setdefault(_RESULTS, {})
    key = (part_index, int(compression))
    if key not in results:
        loop = asyncio.get_running_loop()
        results[key] = loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
    return await results[key]


def register_missing(container: Any, peer_index: int, zero: bool) -> None:
    """hivemind's ``register_failed_reducer`` (partition.py:128-136): the parts of groupmate ``peer_index``'s
    slice that did not come back. hivemind keeps this peer's own numbers there; with ``zero`` (a round that
    must end with one result, item 38) the slice comes back as zeros, which every groupmate that lost the
    same reducer holds alike. Either way the parts count in ``failed_size``."""
    if not zero or not container.return_deltas:
        container.register_failed_reducer(peer_index)
        return
    for part_index in range(
        container._outputs_registered_by_peer[peer_index], container.num_parts_by_peer[peer_index]
    ):
        part = container._input_parts_by_peer[peer_index][part_index][0]
        container.register_processed_part(peer_index, part_index, -part)  # part + delta = 0
        container.failed_size += part.numel()


class Gathered(dict):
    """What an averaging round gathered, by peer, without the groupmates that never learnt of the group;
    ``strangers`` names those (item 11). Travels from the averager process to the peer's (pickled)."""

    strangers: frozenset = frozenset()
    # the share of this peer's numbers that came back averaged: below 1 when a reducer failed or was too slow
    # (the rest of that reducer's slice holds this peer's own numbers, or zeros: :func:`register_missing`)
    received: float = 1.0

    @classmethod
    def without(cls, gathered: dict, strangers: Any, received: float = 1.0) -> Gathered:
        out = cls((peer, data) for peer, data in gathered.items() if peer not in strangers)
        out.strangers, out.received = frozenset(strangers), received
        return out


class NamesStrangers:
    """Mixin for hivemind's gradient averagers: a round's result names the strangers (item 11) and the share
    of this peer's numbers that came back averaged. Runs in the averager process; needs :func:`install`
    (which notes the strangers on the round's runner)."""

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        # the round's runner stays registered until this returns (averager.py, _register_allreduce_group)
        future = self._running_groups.get(group_info.group_id)
        runner = future.result() if future is not None and future.done() else None
        strangers = getattr(runner, _STRANGERS, ())
        container = getattr(runner, "tensor_part_container", None)
        failed, total = getattr(container, "failed_size", 0), getattr(container, "total_size", 0)
        received = 1.0 - failed / total if failed and total else 1.0
        return Gathered.without(gathered, strangers, received) if strangers or received < 1 else gathered


def _packable(averager: Any) -> bool:
    from hivemind.compression import SizeAdaptiveCompression
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

    return not isinstance(averager, PowerSGDGradientAverager) and not isinstance(
        averager.allreduce_kwargs.get("compression"), SizeAdaptiveCompression
    )


class PacksParts:
    """Mixin for hivemind's averagers: one all-reduce buffer per dtype and role (item 3). Not with
    size-dependent compression (``int8`` would then quantize small tensors with large ones), and not for
    PowerSGD, which averages matrices on its own. A failed round leaves the tensors as they were. Runs in
    the averager process."""

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        if not _packable(self) or len(tensors) < 2:
            return await super()._run_allreduce_inplace_(tensors, group_info, *args, **kwargs)
        from hivemind.compression import CompressionInfo

        infos = kwargs.get("tensor_infos") or [
            CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)
        ]
        groups: dict[tuple, list[int]] = {}  # one buffer per dtype and role (roles choose the compression)
        for i, (t, info) in enumerate(zip(tensors, infos, strict=True)):
            groups.setdefault((t.dtype, info.role), []).append(i)
        with torch.no_grad():
            buffers = [torch.cat([tensors[i].detach().reshape(-1) for i in idx]) for idx in groups.values()]
        kwargs["tensor_infos"] = [
            CompressionInfo.from_tensor(buf, key=n, role=role)
            for n, (buf, (_, role)) in enumerate(zip(buffers, groups, strict=True))
        ]
        result = await super()._run_allreduce_inplace_(buffers, group_info, *args, **kwargs)
        with torch.no_grad():  # only a finished round changes the tensors
            for buf, idx in zip(buffers, groups.values(), strict=True):
                for i, part in zip(idx, buf.split([tensors[i].numel() for i in idx]), strict=True):
                    tensors[i].copy_(part.view_as(tensors[i]))
        return result


async def drop_sender(averager: Any, peer_id: Any) -> None:
    """Drop ``peer_id`` as a sender from every round ``averager`` runs now in which it has sent nothing yet
    (item 28): this peer has just refused its parts (it banned ``peer_id`` during the round), and hivemind's
    reducer would otherwise wait ``sender_timeout`` for them, and every groupmate for this peer's slice. Runs
    in the averager process."""
    for future in list(averager._running_groups.values()):
        if not future.done() or future.cancelled() or future.exception() is not None:
            continue
        runner = future.result()
        if peer_id in runner.sender_peer_ids and peer_id not in runner.active_senders:
            await runner._ban_sender(peer_id)


@cache
def packing(base: type) -> type:
    """``base`` (one of hivemind's averager classes) averaging one buffer per dtype and role (item 3). Keeps
    hivemind's class name: the p2p handlers' names are built from it, and must match other peers'."""
    return type(base.__name__, (PacksParts, base), {"__module__": __name__})


def _targets() -> list[tuple[Any, str, Any]]:
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.partition import AllreduceException, BannedException
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.proto import averaging_pb2, runtime_pb2
    from hivemind.utils.asyncio import (
        achain,
        aiter_with_timeout,
        amap_in_executor,
        anext,
        as_aiter,
        attach_event_on_finished,
    )

    from swarm.patches import rpc_guard

    communicate = AllReduceRunner._communicate_with_peer
    generate_input = AllReduceRunner._generate_input_for_peer
    accumulate = AllReduceRunner._accumulate_parts_streaming

    async def _rpc_aggregate_part(self: Any, stream: Any, context: Any) -> Any:
        """hivemind's ``DecentralizedAverager.rpc_aggregate_part``, with a bounded wait for an unknown group
        (item 8). Runs in the averager process."""
        request = await anext(stream)
        # hivemind waits here without a limit, for a leader's answer that is still on its way. A group this
        # averager has assembled and whose trigger it awaits (a pre-scheduled round, averager.py _step) is
        # known, and registers once triggered: that one is waited for as hivemind does. A part can come a
        # little before this averager's matchmaking has noted the group (a groupmate began at once): known
        # is asked again until this process has run for request_timeout: a stall of its own (a starved
        # volunteer's CPU) does not count, or a groupmate's part that came just before it would be refused
        loop = asyncio.get_running_loop()
        limit, waited, last = self._matchmaking.request_timeout, 0.0, loop.time()
        while request.group_id not in self._running_groups:
            if request.group_id == getattr(self._matchmaking, _ASSEMBLED, None):
                await self._pending_groups_registered.wait()
                break
            now = loop.time()
            waited, last = waited + min(now - last, AWAKE_AT_MOST), now
            left = limit - waited
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._pending_groups_registered.wait(), min(left, NOTED_EVERY))
            except TimeoutError:
                continue
            if request.group_id not in self._running_groups:  # another group registered: not this one yet
                await asyncio.sleep(min(left, NOTED_EVERY))
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    # the p2p handler's request type is read from the annotations (hivemind/p2p/servicer.py)
    _rpc_aggregate_part.__annotations__ = get_type_hints(DecentralizedAverager.rpc_aggregate_part)

    async def _communicate_with_peer(self: Any, peer_id: Any) -> None:
        """hivemind's ``AllReduceRunner._communicate_with_peer``; a groupmate whose reducer failed before it
        sent a single part is dropped as a sender too (item 8), instead of being awaited for
        ``sender_timeout``. One that answered ``BAD_GROUP_ID`` (allreduce.py raises "<peer> sent
        BAD_GROUP_ID") never learnt of the group: it is named a stranger (item 11). A groupmate this peer
        has banned gets this peer's parts, and nothing it sends counts here (item 28,
        :func:`_parts_to_banned`)."""
        if peer_id != self.peer_id and rpc_guard.banned_here(peer_id):
            await _parts_to_banned(self, peer_id)
            return
        try:
            if peer_id != self.peer_id:
                await _exchange_parts(self, peer_id)
            elif _one_result(self):
                await _reduce_own_parts(self)
            else:
                await communicate(self, peer_id)
        except Exception as exc:
            if peer_id in self.sender_peer_ids and peer_id not in self.active_senders:
                if str(exc).endswith("sent BAD_GROUP_ID"):
                    self.__dict__.setdefault(_STRANGERS, set()).add(peer_id)
                await self._ban_sender(peer_id)
            raise

    async def _reduce_own_parts(self: Any) -> None:
        """hivemind's ``_communicate_with_peer`` for this peer's own parts (allreduce.py:204-210), which
        takes the average through the same serialization as the senders that asked for it (item 35)."""
        container, loop = self.tensor_part_container, asyncio.get_running_loop()
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            info = container._input_parts_by_peer[peer_index][part_index][1]
            serialized = await _serialized_average(
                self, part_index, averaged, _compression_type(container.compression, info)
            )
            decoded = await loop.run_in_executor(None, deserialize_torch_tensor, serialized)
            container.register_processed_part(peer_index, part_index, decoded - tensor_part)

    async def _exchange_parts(self: Any, peer_id: Any) -> None:
        """hivemind's ``_communicate_with_peer`` for a groupmate's slice (allreduce.py:212-257). Where the
        round must end with one result, this peer's parts go out marked :data:`ONE_RESULT`
        (:func:`_generate_marked`), and an answer marked so is the average itself, turned here into the
        difference from this peer's part that hivemind expects. An unmarked answer is hivemind's difference
        between the average and the part as the reducer decoded it: it is added to that decoded part, not to
        this peer's own numbers before compression (item 36)."""
        container = self.tensor_part_container
        peer_index = self.ordered_peer_ids.index(peer_id)
        own = container._input_parts_by_peer[peer_index]
        sent = self.__dict__.setdefault(_SENT, {}).setdefault(peer_index, [])
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def decode(msg: Any, index: int) -> torch.Tensor:
                """The difference from this peer's part ``index`` that the answer ``msg`` gives."""
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                if index >= len(own):
                    raise AllreduceException(f"peer {peer_id} sent more than {len(own)} parts")
                value = deserialize_torch_tensor(msg.tensor_part)
                if msg.peer_id == ONE_RESULT:  # the average itself
                    return value - own[index][0]
                # the reducer answers only parts it has received, so this one went out, as sent[index]
                part = sent[index] if index < len(sent) else None
                if part is None:  # sent uncompressed: as decoded, it is this peer's own part
                    return value
                return value + (deserialize_torch_tensor(part) - own[index][0])

            part_index = 0
            replies = aiter_with_timeout(stream, self.reducer_timeout)
            indices = as_aiter(*range(len(own) + 1))  # one past the end: a reply too many is an error
            async for delta in amap_in_executor(decode, replies, indices, max_prefetch=container.prefetch):
                container.register_processed_part(peer_index, part_index, delta)
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise AllreduceException(
                    f"peer {peer_id} sent {part_index} parts, but we expected "
                    f"{container.num_parts_by_peer[peer_index]}"
                )
        except BaseException as exc:
            if isinstance(exc, Exception):
                log.debug("Caught %r when communicating to %s", exc, peer_id, exc_info=True)
            register_missing(container, peer_index, zero=_one_result(self))
            raise

    async def _generate_marked(self: Any, peer_index: int) -> Any:
        """hivemind's ``_generate_input_for_peer``; the first part of a round that must end with one result
        asks its reducer for the average itself (item 35). Each part sent is kept, as sent, until the round
        ends: the reducer's difference is from that (item 36); an uncompressed one is noted as None (it is
        this peer's own numbers)."""
        first = _one_result(self)
        sent = self.__dict__.setdefault(_SENT, {}).setdefault(peer_index, [])
        lossless = runtime_pb2.CompressionType.NONE
        async for message in generate_input(self, peer_index):
            sent.append(None if message.tensor_part.compression == lossless else message.tensor_part)
            if first:
                message.peer_id, first = ONE_RESULT, False
            yield message

    async def _accumulate_answering(self: Any, stream: Any, sender_index: int) -> Any:
        """hivemind's ``_accumulate_parts_streaming`` (allreduce.py:333-362). To a sender whose first part
        asked for it, each answer is the part's average, serialized once for every such sender (item 35);
        to others, hivemind's difference from their part."""
        request = await anext(stream)
        stream = achain(as_aiter(request), stream)
        if request.peer_id != ONE_RESULT:
            async for message in accumulate(self, stream, sender_index):
                yield message
            return

        def read(msg: Any) -> tuple[torch.Tensor, float, Any]:
            return deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression

        part_index = 0
        try:
            async for tensor_part, weight, compression in amap_in_executor(
                read, stream, max_prefetch=self.tensor_part_container.prefetch
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # banned in the background: its parts no longer count
                serialized = await _serialized_average(self, part_index - 1, averaged, compression)
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=serialized, peer_id=ONE_RESULT
                )
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _parts_to_banned(self: Any, peer_id: Any) -> None:
        """A round whose group holds ``peer_id``, which this peer banned (before the round, or during it:
        another groupmate that has not banned it assembled the group). This peer's reducer counts none of its
        parts from now on (this peer's averager refuses them, swarm/patches/rpc_guard.py), and its slice of
        the result keeps this peer's own numbers; but this peer sends it its parts, as hivemind does: its
        reducer may have counted on them (it called this peer's reducer before the ban), and would wait
        ``sender_timeout`` for them, and the other groupmates for its slice. What it sends back is read
        and not used. Runs in the averager process."""
        index = self.ordered_peer_ids.index(peer_id)
        if peer_id in self.sender_peer_ids:
            await self._ban_sender(peer_id)
        self.tensor_part_container.register_failed_reducer(index)
        if self.peer_id not in self.sender_peer_ids:
            return
        try:
            parts = self._generate_input_for_peer(index)
            with rpc_guard.sending_to_banned():
                stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(parts)
            async for _ in aiter_with_timeout(stream, self.reducer_timeout):
                pass
        except Exception as exc:  # its own round is its affair
            log.debug("Sending parts to the banned groupmate %s failed: %r", peer_id, exc)

    from hivemind.averaging.matchmaking import Matchmaking

    look_for_group = Matchmaking.look_for_group

    async def _look_for_group_noting(self: Any, step: Any) -> Any:
        """hivemind's ``Matchmaking.look_for_group``, noting the id of the group it assembled (item 8: the
        averager's trigger may come later, and parts of that group must wait for it)."""
        group_info = await look_for_group(self, step)
        setattr(self, _ASSEMBLED, None if group_info is None else group_info.group_id)
        return group_info

    return [
        (DecentralizedAverager, "rpc_aggregate_part", _rpc_aggregate_part),
        (AllReduceRunner, "_communicate_with_peer", _communicate_with_peer),
        (AllReduceRunner, "_generate_input_for_peer", _generate_marked),
        (AllReduceRunner, "_accumulate_parts_streaming", _accumulate_answering),
        (Matchmaking, "look_for_group", _look_for_group_noting),
    ]


PATCH = Patch("allreduce", _targets)
