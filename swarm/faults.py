"""Fault injection for the fault-tolerance tests: a peer kills itself at a chosen moment of a global epoch,
or corrupts its own gradients or parameters, exactly as a crash, a reclaimed machine or a bug would.

Off unless ``train.inject_fault`` is set (the hidden ``--inject-fault`` flag). A spec is a comma-separated
list of ``kind@epoch`` or ``kind@epochxcount`` items, e.g. ``kill:allreduce@5`` or
``nan_grad@3x4,nan_params@6``. ``kind@+E`` counts E from the global epoch at which the peer started
(after loading the swarm's state), e.g. ``kill:allreduce@+2`` for a peer that joins a running swarm:

- ``kill:accumulating@E``: SIGKILL to the peer's whole process group from global epoch E on, after the
  first local step that leaves samples accumulated toward the swarm's next batch (mid-accumulation).
- ``kill:matchmaking@E``: the same, from the gradient averager process, while it looks for an averaging
  group, once the peer has reached epoch E.
- ``kill:allreduce@E``: the same, in the middle of a gradient all-reduce (after the first averaged part
  has arrived), once the peer has reached epoch E.
- ``nan_grad@ExN`` / ``inf_grad@ExN``: the first N local steps from epoch E produce NaN (Inf) gradients.
- ``big_grad@ExN``: the first N local steps from epoch E produce gradients 10,000 times too large and
  pointing uphill (-10^4 times the true gradient), as an attacker would send them (what
  swarm/averaging/screen.py is for). Only 10,000 times too large, AdamW would barely notice: its update does
  not depend on the gradient's scale (measured: a swarm with such a peer and no screen went on from val acc
  0.66 to 0.89).
- ``flip_grad@ExN``: the first N local steps from epoch E produce gradients of an honest size pointing
  uphill (-8 times the true gradient): an invited peer that wants the run to fail, within the screen's 10x
  (what swarm/patches/robust.py is for). ``flip_grad:K@ExN`` multiplies by -K instead (K a whole number).
- ``random_grad@ExN``: the first N local steps from epoch E replace each parameter's gradient by a random
  direction of the same norm: numbers of an honest size that carry no information (noise in the mean).
- ``nan_params@E``: the parameters turn NaN right after the averaging that ends epoch E.
- ``wander@E``: right after the averaging that ends epoch E, the parameters become random numbers of each
  parameter's own norm: a peer whose state went astray (a bug, a stale state) and that is honest otherwise
  (what ``DonorCheck.astray`` of swarm/averaging/donors.py is for).
- ``bad_state@E``: from global epoch E on, the peer sends random numbers of each parameter's own norm (drawn
  from the epoch as a seed) instead of its parameters in every state round, and tells its groupmates in the
  gradient round that it holds another state, so that the state round is held rather than skipped (item 16
  of docs/hivemind-patches.md). It trains and averages gradients honestly otherwise.
- ``bad_donor@E``: from global epoch E on, the peer declares itself the donor of the newest state (its
  epoch + ``BAD_DONOR_LEAD``, so that newcomers ask it first) and serves, at its real epoch, random numbers
  of each parameter's own norm instead of its parameters, drawn from the epoch as a seed (so that bad donors
  at one epoch serve one state), and publishes that state's sketch as its own (what
  swarm/averaging/donors.py is for). It trains and averages honestly otherwise.
- ``claim_epoch@E``: from global epoch E on, the peer's progress records claim its epoch + ``CLAIM_LEAD``
  (10^6; ``claim_epoch:K`` claims K ahead; hivemind takes the swarm's epoch from the largest record, a peer
  behind it downloads, and a peer one epoch behind steps at once), while its
  own reads see its real epoch: it declares its real epoch as a donor, serves its real state, and trains and
  averages honestly (what item 25 of docs/hivemind-patches.md is for).
- ``abandon:join@E``: from global epoch E, the first time the gradient averager asks a leader to take it
  into a group, it gives up before the answer, as a follower whose process is starved for longer than
  ``request_timeout`` does (the leader has taken it in nonetheless; docs/hivemind-patches.md items 8 and 11).
  Once; the peer lives on. Only a follower asks, so it fires at the first round from E in which this peer
  joins another's group.
- ``kill:rank@E`` (``swarm-peer local`` only): the last rank SIGKILLs itself when the run reaches global
  epoch E, on torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), as a lost machine would.

Before it kills, the peer prints one ``FAULT INJECTED: ...`` line, so that a test can time the moment.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and hivemind load only when a fault is injected: the config parses specs cheaply
    import torch
    from hivemind.averaging.control import StepControl

KILL_KINDS = ("kill:accumulating", "kill:matchmaking", "kill:allreduce")
GRAD_KINDS = ("nan_grad", "inf_grad", "big_grad", "flip_grad", "random_grad")
BIG_GRAD_SCALE = -1e4
FLIP_GRAD_SCALE = -8.0
LOCAL_KILL = "kill:rank"  # swarm-peer local: the last rank SIGKILLs itself at global epoch E (first attempt)
ABANDON_JOIN = "abandon:join"
BAD_DONOR, BAD_STATE = "bad_donor", "bad_state"
BAD_DONOR_LEAD = 100  # epochs by which a bad donor's declared priority runs ahead of its epoch
CLAIM_EPOCH, CLAIM_LEAD = "claim_epoch", 10**6  # epochs by which its progress records run ahead of its epoch
PARAM_KINDS = ("nan_params", "wander")
KINDS = (*KILL_KINDS, *GRAD_KINDS, *PARAM_KINDS, BAD_DONOR, BAD_STATE, CLAIM_EPOCH, ABANDON_JOIN, LOCAL_KILL)
_ARMED_NONE, _ARMED_MATCHMAKING, _ARMED_ALLREDUCE, _ARMED_ABANDON, _ABANDONED = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Fault:
    """One fault: what happens, at which global epoch, and (for gradients) for how many local steps."""

    kind: str
    epoch: int
    count: int = 1
    relative: bool = False  # epoch counts from the peer's first global epoch
    scale: float | None = None  # flip_grad:K: the gradients times -K; claim_epoch:K: the epochs claimed ahead


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    """Parse ``kind@epoch[xcount],...``; raises ValueError naming the bad item and the allowed kinds."""
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, when = item.partition("@")
        relative = when.startswith("+")
        epoch, _, count = when.lstrip("+").partition("x")
        scale = None
        if kind.startswith("flip_grad:") and kind.partition(":")[2].isdigit():
            kind, scale = "flip_grad", -float(kind.partition(":")[2])
        if kind.startswith(f"{CLAIM_EPOCH}:") and kind.partition(":")[2].isdigit():
            kind, scale = CLAIM_EPOCH, float(kind.partition(":")[2])
        if kind not in KINDS or not epoch.isdigit() or (count and not count.isdigit()):
            raise ValueError(
                f"inject_fault item {item!r} is invalid: expected kind@[+]epoch or kind@[+]epochxcount with "
                f"kind one of {', '.join(KINDS)} (flip_grad:K for gradients times -K, claim_epoch:K for "
                "epochs claimed K ahead)"
            )
        faults.append(Fault(kind, int(epoch), int(count) if count else 1, relative, scale))
    return tuple(faults)


def kill_own_group(where: str) -> None:
    """Print the fault line, then SIGKILL every process of this peer (its process group), this one too."""
    print(f"FAULT INJECTED: SIGKILL to the peer's process group {where}", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(60)  # never reached: the signal is delivered at once


class FaultInjector:
    """Applies the parsed faults from inside the peer. The strategy calls its hooks; kills inside an
    averaging round run in the gradient averager's own process, armed through shared memory."""

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        self.faults = faults
        self.started = False
        self.armed = mp.Value("i", _ARMED_NONE)  # created before hivemind forks the averager: shared
        self._grad_left = {f: f.count for f in faults if f.kind in GRAD_KINDS}
        self._params_done: set[Fault] = set()

    def start(self, epoch: int) -> None:
        """The peer trains from global epoch ``epoch`` on: fix the epochs of relative faults."""
        if not self.started:
            self.started = True
            self.faults = tuple(
                Fault(f.kind, f.epoch + epoch, f.count, scale=f.scale) if f.relative else f
                for f in self.faults
            )
            self._grad_left = {f: f.count for f in self.faults if f.kind in GRAD_KINDS}

    def grad_averager_factory(self, base: type, **kwargs: Any) -> Any:
        """The gradient averager class ``base`` for hivemind.Optimizer, with the kill hooks if any are asked
        for."""
        if any(f.kind in ("kill:matchmaking", "kill:allreduce", ABANDON_JOIN) for f in self.faults):
            return partial(_make_faulty_averager(base), armed=self.armed, **kwargs)
        return partial(base, **kwargs)

    def on_local_step(self, epoch: int, samples_accumulated: int) -> None:
        """After each local step: kill mid-accumulation, or arm the averager's kill for this epoch."""
        for fault in self.faults:
            if fault.epoch > epoch:
                continue
            if fault.kind == "kill:accumulating" and samples_accumulated > 0:
                kill_own_group(
                    f"mid-accumulation ({samples_accumulated} samples toward global epoch {epoch + 1})"
                )
            elif fault.kind == "kill:matchmaking":
                self.armed.value = _ARMED_MATCHMAKING
            elif fault.kind == "kill:allreduce":
                self.armed.value = _ARMED_ALLREDUCE
            elif fault.kind == ABANDON_JOIN and self.armed.value == _ARMED_NONE:
                self.armed.value = _ARMED_ABANDON  # the averager process sets _ABANDONED once it has

    def corrupt_gradients(self, module: torch.nn.Module, epoch: int) -> bool:
        """Turn this step's gradients NaN, Inf, outsized, flipped or random if a gradient fault is due; True
        if it did."""
        for fault, left in self._grad_left.items():
            if left > 0 and epoch >= fault.epoch:
                self._grad_left[fault] = left - 1
                if fault.kind in ("big_grad", "flip_grad", "random_grad"):
                    scale = BIG_GRAD_SCALE if fault.kind == "big_grad" else (fault.scale or FLIP_GRAD_SCALE)
                    what = (
                        "random gradients of an honest norm"
                        if fault.kind == "random_grad"
                        else f"gradients x{scale:g}"
                    )
                    if left == fault.count:
                        print(
                            f"FAULT INJECTED: {what} for {fault.count} local steps from global epoch {epoch}",
                            flush=True,
                        )
                    for p in module.parameters():
                        if p.grad is None:
                            continue
                        if fault.kind == "random_grad":
                            noise = p.grad.new_empty(p.grad.shape).normal_()
                            p.grad.copy_(noise * (p.grad.norm() / noise.norm().clamp(min=1e-12)))
                        else:
                            p.grad.mul_(scale)
                    return True
                value = float("nan") if fault.kind == "nan_grad" else float("inf")
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.fill_(value)
                        break
                return True
        return False

    def serve_bad_state(self, state_averager: Any, epoch: int) -> bool:
        """From a ``bad_donor`` fault's epoch on, after each global step: declare the newest state and serve
        random numbers of each parameter's own norm; True if it did."""
        fault = next((f for f in self.faults if f.kind == BAD_DONOR and epoch >= f.epoch), None)
        if fault is None:
            return False
        if state_averager.serve_filter is None:
            print(
                f"FAULT INJECTED: serving random parameters as the newest state from global epoch {epoch}",
                flush=True,
            )
            state_averager.serve_filter = _random_of_the_same_norms
        if not state_averager.client_mode:
            state_averager.state_sharing_priority = epoch + BAD_DONOR_LEAD
        return True

    def send_bad_state(self, opt: Any, epoch: int) -> bool:
        """From a ``bad_state`` fault's epoch on: random parameters in every state round (the state averager's
        ``round_filter``), and a gradient round's all-gather that asks for the state round; True if due."""
        fault = next((f for f in self.faults if f.kind == BAD_STATE and epoch >= f.epoch), None)
        if fault is None:
            return False
        averager = opt.state_averager
        if averager.round_filter is None:
            print(f"FAULT INJECTED: random parameters in state rounds from global epoch {epoch}", flush=True)
            averager.round_filter = _random_of_the_same_norms
            honest = getattr(opt.grad_averager, "gather_hook", None)
            if honest is not None:  # no summary of its state: the group's state round is held (item 16)
                opt.grad_averager.gather_hook = lambda: {**honest(), "state": None}
        return True

    def claim_epochs(self, tracker: Any, epoch: int) -> bool:
        """From a ``claim_epoch`` fault's epoch on: the progress records that ``tracker`` (the peer's
        hivemind ProgressTracker) stores claim the epoch + CLAIM_LEAD, and its own reads see its own record
        with its real progress; True if due."""
        fault = next((f for f in self.faults if f.kind == CLAIM_EPOCH and epoch >= f.epoch), None)
        if fault is None:
            return False
        if not isinstance(tracker.dht, _ClaimingDHT):
            from hivemind.utils import ValueWithExpiration

            lead = int(fault.scale) if fault.scale else CLAIM_LEAD
            print(
                f"FAULT INJECTED: progress records claim global epoch {epoch + lead} from global epoch "
                f"{epoch}",
                flush=True,
            )
            tracker.dht = _ClaimingDHT(tracker.dht, tracker.training_progress_key, lead)
            parse, own = tracker._parse_swarm_progress_data, tracker._local_public_key

            def parsed(metadata: Any) -> Any:
                if isinstance(metadata, dict) and own in metadata:
                    real = ValueWithExpiration(tracker.local_progress.dict(), metadata[own].expiration_time)
                    metadata = {**metadata, own: real}
                return parse(metadata)

            tracker._parse_swarm_progress_data = parsed
        return True

    def corrupt_parameters(self, module: torch.nn.Module, epoch: int) -> bool:
        """Right after the averaging that ended ``epoch``, if due: turn one parameter NaN (``nan_params``), or
        every parameter into random numbers of its own norm (``wander``); True if it did."""
        for fault in self.faults:
            if fault.kind in PARAM_KINDS and epoch >= fault.epoch and fault not in self._params_done:
                self._params_done.add(fault)
                import torch

                with torch.no_grad():
                    if fault.kind == "nan_params":
                        next(module.parameters()).fill_(float("nan"))
                        return True
                    params = list(module.parameters())
                    for p, q in zip(params, _random_of_the_same_norms(params, epoch), strict=True):
                        p.copy_(q)
                print(f"FAULT INJECTED: the parameters went astray after global epoch {epoch}", flush=True)
                return True
        return False


class _ClaimingDHT:
    """A hivemind.DHT as a ``claim_epoch`` peer's progress tracker sees it: a progress record it stores
    under ``key`` claims its epoch + ``lead`` (the DHT process signs what it is given); the rest goes to
    ``dht``."""

    def __init__(self, dht: Any, key: str, lead: int = CLAIM_LEAD) -> None:
        self._dht, self._key, self._lead = dht, key, lead

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)

    def store(self, *args: Any, **kwargs: Any) -> Any:
        value = kwargs.get("value")
        if kwargs.get("key") == self._key and isinstance(value, dict) and isinstance(value.get("epoch"), int):
            kwargs["value"] = {**value, "epoch": value["epoch"] + self._lead}
        return self._dht.store(*args, **kwargs)


def _random_of_the_same_norms(params: list[torch.Tensor], epoch: int) -> list[torch.Tensor]:
    """Random numbers of each parameter's own norm, drawn from a generator seeded with ``epoch``: bad donors
    at one epoch serve one state (they collude), and each vouches for it in its metrics record."""
    import torch

    gen = torch.Generator().manual_seed(epoch)
    out = []
    for p in params:
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        out.append(noise * (p.norm() / noise.norm().clamp(min=1e-12)))
    return out


@cache
def _make_faulty_averager(base: type) -> type:
    from hivemind.averaging.control import AveragingStage

    # the class keeps hivemind's name: RPC handler names are built from it, and must match other peers'
    class GradientAverager(base):  # type: ignore[misc,valid-type]
        """A GradientAverager that kills its peer during matchmaking or an all-reduce when armed."""

        def __init__(self, *args: Any, armed: Any, **kwargs: Any) -> None:
            self._fault_armed = armed
            super().__init__(*args, **kwargs)

        async def _step(self, *, step: StepControl, future_for_init: Any) -> Any:
            if self._fault_armed.value == _ARMED_MATCHMAKING:
                asyncio.get_event_loop().create_task(self._kill_in_matchmaking(step))
            elif self._fault_armed.value == _ARMED_ABANDON and "_request_join_group" not in vars(
                self._matchmaking
            ):
                self._matchmaking._request_join_group = partial(
                    _abandon_first_join, self._matchmaking, self._matchmaking._request_join_group, self
                )
            return await super()._step(step=step, future_for_init=future_for_init)

        async def _kill_in_matchmaking(self, step: StepControl) -> None:
            # a follower can find its group within milliseconds, so poll often and kill at the first sight
            while not step.done():
                if step.stage == AveragingStage.LOOKING_FOR_GROUP:
                    kill_own_group("while looking for an averaging group (matchmaking)")
                await asyncio.sleep(0.005)

        # hivemind reads _averaging_alpha once per averaged part it receives in an all-reduce, so this
        # property is the one place that runs in the middle of a round, after other peers sent their parts
        @property
        def _averaging_alpha(self) -> float:
            if self._fault_armed.value == _ARMED_ALLREDUCE:
                kill_own_group("in the middle of a gradient all-reduce (first averaged part received)")
            return self._alpha_value

        @_averaging_alpha.setter
        def _averaging_alpha(self, value: float) -> None:
            self._alpha_value = value

    return GradientAverager


async def send_join_request(matchmaking: Any, leader: Any) -> Any:
    """Ask ``leader`` to take this averager (hivemind's ``Matchmaking``) into its group, as
    ``_request_join_group`` does; returns the open stream of the leader's answers, unread."""
    from hivemind.proto import averaging_pb2

    stub = matchmaking._servicer_type.get_stub(matchmaking._p2p, leader, namespace=matchmaking._prefix)
    return await stub.rpc_join_group(
        averaging_pb2.JoinRequest(
            schema_hash=matchmaking.schema_hash,
            expiration=matchmaking.get_request_expiration_time(),
            client_mode=matchmaking.client_mode,
            gather=matchmaking.step_control.data_for_gather,
            group_key=matchmaking.group_key_manager.current_key,
        )
    )


async def _abandon_first_join(matchmaking: Any, original: Any, averager: Any, leader: Any) -> Any:
    """hivemind's ``Matchmaking._request_join_group``, except when the ``abandon:join`` fault is armed: then
    the request is sent, its stream kept open and never read, and the follower looks on as if the leader had
    not answered within ``request_timeout``. Runs in the gradient averager's process."""
    if averager._fault_armed.value != _ARMED_ABANDON:
        return await original(leader)
    averager._fault_armed.value = _ABANDONED
    averager._abandoned_stream = await send_join_request(matchmaking, leader)  # kept open, never read
    print("FAULT INJECTED: gave up on a join request before the leader's answer (abandon:join)", flush=True)
    await asyncio.sleep(matchmaking.request_timeout)  # the starved follower's wait
    return None
