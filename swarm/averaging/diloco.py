"""DiLoCo (Douillard et al. 2023): many local steps, then one averaged outer step.

Each peer trains its own copy of the model with the inner optimizer (AdamW) for ``local_steps`` steps.
It then offers its *pseudo-gradient*, the anchor (the parameters after the last outer step) minus its
current parameters, to the swarm. The peers average their pseudo-gradients (hivemind's gradient averager,
with ``--compression``), and an outer Nesterov SGD (lr 0.7, momentum 0.9 by default, as in the paper) takes
one step on the anchor with that average. Every peer that took part then starts from the same new anchor.

The anchors and the outer SGD are what ``hivemind.Optimizer`` manages: its "parameters" are the anchors
(float32, on the CPU), and its "gradients" are the pseudo-gradients. The inner AdamW's moments and step
counts travel as hivemind's ``extra_tensors``, so a newcomer downloads the anchors, the outer momentum and
the inner state in one go.

A peer that finishes its local steps waits (as in the paper, synchronously) until the swarm as a whole has
accumulated ``target_batch_size`` samples, or until hivemind's estimate of when that happens has passed
(a peer that died is not waited for), or until its round's group has formed: a peer looks for a group only
once its inner phase is over (:func:`group_formed`; but see ``match_early`` below), so a formed group has
every member's pseudo-gradient and the peer need not wait for its own reads of the swarm's progress to
show the others done (in a 2-peer run on 2 cores that wait was 51 ms of the 113 ms that ended each outer
round). If the swarm is ready before this peer has done its local steps, it joins the round early rather
than miss it. While it waits it reads the swarm's progress every ``WAITING_READS_EVERY`` (50 ms).

With ``round_seconds`` (``--round-seconds``) the inner phase is bounded by time instead: the target batch
follows the swarm's summed speed (swarm/patches/progress.py ``pace_by_time``), and every peer takes inner
steps until the swarm is ready, so volunteers of unequal speed reach the round together, none idle, and each
pseudo-gradient counts in proportion to the samples behind it (hivemind weighs each peer by the samples it
reports). ``local_steps`` then plays no part.

With ``overlap`` (``--overlap-rounds``) a peer does not wait for its outer round: it hands the round (the
wait for the swarm, matchmaking, the all-reduce and the outer step) to a background thread and goes on with
inner steps from where it is. When the round lands, the new anchor replaces the old one under the steps
taken meanwhile: parameters = new anchor + (parameters now - parameters at the end of the phase), so nothing
computed during the round is lost, and the next pseudo-gradient (new anchor - parameters) covers those steps.
The outer update thus reaches the parameters one round late, as in Streaming DiLoCo (Douillard et al. 2025)
and eager DiLoCo (Kale et al. 2025). Samples computed during the round count toward the next one. A
volunteer behind a slow, distant link then computes through matchmaking and the all-reduce instead of
waiting them out.

With ``match_early`` (``--match-early``, with ``round_seconds``) a peer looks for its round's group while it
still computes, once the swarm's estimated end of the phase is within ``matchmaking_time`` (hivemind's own
pre-scheduling, optimizer.py ``_maybe_schedule_gradient_averaging``, which a DiLoCo peer otherwise reaches
only at its outer step). Paced by time, every peer's phase ends when the tracker says the swarm is ready, so
a group formed early is one whose members end their phases together.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from swarm.patches import progress

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)
INNER_KEYS = ("step", "exp_avg", "exp_avg_sq")
# While a peer waits for the swarm after its inner steps it reads the swarm's progress this often (seconds),
# not every min_refresh_period (0.5 s): the read that shows the others done ended most outer rounds. In 3
# alternating pairs of 2-peer runs (H=50, 25 outer rounds) 7666 samples/s against 6209 at
# 0.5 s, median round end 0.10 s against 0.175 s; 0.02 s gave 7926 against 7842 at 0.05 (the noise), for
# more than twice the reads. A waiting peer has nothing to compute, so the reads cost the swarm little.
WAITING_READS_EVERY = 0.05


def inner_state_tensors(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The inner AdamW's state as a flat list of tensors, created (as zeros) where missing.

    Created up front so that hivemind can share them with newcomers before the first step. The zeros are
    what AdamW itself starts from; no virtual step is taken (a step with zero gradients would still apply
    weight decay).
    """
    tensors = []
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if not state:
                # where torch's own AdamW puts it: on the parameter's device for the fused and capturable
                # kernels (the fused CUDA kernel refuses a step on the CPU), else on the CPU
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            missing = [k for k in INNER_KEYS if k not in state]
            if missing:
                raise ValueError(
                    f"DiLoCo's inner optimizer must be AdamW or Adam (state {', '.join(INNER_KEYS)}); "
                    f"{type(inner).__name__} has no {', '.join(missing)}"
                )
            tensors.extend(state[k] for k in INNER_KEYS)
    return tensors


def state_averager_prefix(run_id: str) -> str:
    """The DHT prefix under which a run's state is shared: hivemind.Optimizer names its state averager so
    (hivemind/optim/optimizer.py:286), and the monitor downloads from the same one."""
    return f"{run_id}_state_averager"


def shared_state(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor],
    averaging: str,
    outer_lr: float,
    outer_momentum: float,
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """What a run's state averager holds, as (the optimizer whose parameters and state it shares, the extra
    tensors): with gradient averaging, ``inner`` itself and nothing more; with DiLoCo, the outer SGD over
    ``params`` (a peer's anchors, or the monitor's model) and the inner AdamW's state. Peers and the monitor
    build it here, so that a download always matches what the peers share."""
    if averaging != "diloco":
        return inner, []
    return outer_optimizer(params, outer_lr, outer_momentum), inner_state_tensors(inner)


def averaged_statistics(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The state of the swarm's ``optimizer`` that a state round averages with its parameters (hivemind's
    ``average_opt_statistics``), so that peers that parted (a missed or partial round, a first outer step
    taken alone) hold one state again after it: Adam's moments, SGD's momentum (DiLoCo's outer optimizer).
    Left out, SGD momenta that differ part the anchors again at every outer step, and the peers never agree
    on one state (docs/hivemind-patches.md item 16)."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return ("exp_avg", "exp_avg_sq")
    if isinstance(optimizer, torch.optim.SGD) and any(g["momentum"] > 0 for g in optimizer.param_groups):
        return ("momentum_buffer",)
    return ()


def outer_optimizer(params: list[torch.Tensor], lr: float, momentum: float) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def group_formed(opt: hivemind.Optimizer) -> bool:
    """Whether ``opt``'s gradient round has its group and awaits this peer's trigger. A DiLoCo peer calls
    hivemind's ``step`` only at its outer step, and only that step starts matchmaking (optimizer.py,
    ``_maybe_schedule_gradient_averaging``): every member of a formed group has finished its inner phase.
    A search that found nobody by the round's deadline also awaits the trigger, with no group
    (matchmaking.py ``look_for_group`` returns None; averager.py ``_step``): not formed."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    control = opt.scheduled_grads
    if control is None or control.done() or control.stage != AveragingStage.AWAITING_TRIGGER:
        return False
    return get_dht_time() < control.deadline


def read_while_waiting(tracker: Any) -> None:
    """One turn of a waiting peer's reads: have ``tracker`` read the swarm's progress within
    ``WAITING_READS_EVERY`` (swarm/patches/progress.py ``read_within``)."""
    progress.read_within(tracker, WAITING_READS_EVERY)


class DiLoCo:
    """The inner/outer bookkeeping of one peer; ``HivemindStrategy`` calls it after every local step."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        local_steps: int,
        round_seconds: float = 0.0,
        outer_lr: float,
        outer_momentum: float,
        should_stop=lambda: False,
        before_outer_step=lambda: False,
        overlap: bool = False,
        match_early: bool = False,
    ) -> None:
        self.inner, self.local_steps = inner, local_steps
        # > 0: the inner phase ends when the swarm is ready (its target paced to this many seconds of its
        # compute, swarm/patches/progress.py pace_by_time), not after local_steps
        self.round_seconds = round_seconds
        self.full_phase_steps = 0  # inner steps of this peer's last phase that ran a whole round
        # the strategy's StateGuard.undo_nonfinite_update: nothing non-finite leaves in a pseudo-gradient
        self.before_outer_step = before_outer_step
        self.params = [p for group in inner.param_groups for p in group["params"]]
        # the anchors: float32 copies on the CPU, where hivemind's averagers live anyway
        self.anchors = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in self.params
        ]
        self.outer, self.extra_tensors = shared_state(inner, self.anchors, "diloco", outer_lr, outer_momentum)
        self.should_stop = should_stop
        self.steps = self.samples = 0  # since the last outer step
        self.outer_steps = 0
        self.waited = 0.0  # seconds spent waiting for the swarm, in total
        self.rounds_on_formed_group = 0  # outer rounds begun on a formed group, before the tracker was ready
        self.loaded: dict[str, float] | None = None  # state_norms() right after the first download
        # the steps behind the pseudo-gradient of the round in progress (or the last one)
        self.sent_steps = 0
        # overlap: the outer round runs in a background thread while the inner steps go on
        self.overlap = overlap
        self.match_early = match_early and round_seconds > 0  # phases end when the swarm is ready
        self._flight: threading.Event | None = None  # set when the round in flight has ended
        self._rounds: queue.SimpleQueue | None = None  # the background thread's work: (epoch, samples, done)
        self._flight_epoch = 0  # the global epoch the round in flight started from
        self._flight_began = 0.0
        self._phase_began = time.perf_counter()  # when this peer's step count last restarted
        self._sent_phase_began = self._phase_began  # the same, for the pseudo-gradient in flight
        self._flight_error: BaseException | None = None
        self._phase_end: list[torch.Tensor] = []  # the parameters whose pseudo-gradient is in flight
        self.last_flight = 0.0  # seconds the last round that landed ran in the background
        self.flight_seconds = 0.0  # in total
        self._sent_samples = 0  # the samples behind the pseudo-gradient in flight (its steps: sent_steps)

    def attach(self, opt: hivemind.Optimizer) -> None:
        self.opt = opt
        self._phase_began = time.perf_counter()
        if self.overlap:
            # one thread for every round, started once
            self._rounds = queue.SimpleQueue()
            threading.Thread(target=self._serve_rounds, name="diloco-outer-rounds", daemon=True).start()

    def _serve_rounds(self) -> None:
        rounds = self._rounds
        assert rounds is not None
        while (work := rounds.get()) is not None:
            epoch, samples, done = work
            try:
                self._outer_round(epoch, samples)
            except BaseException as exc:  # raised again in the training thread when the round lands
                self._flight_error = exc
            finally:
                done.set()

    def detach(self) -> None:
        """Stop the background thread (after the last round has landed)."""
        if self._rounds is not None:
            self._rounds.put(None)
            self._rounds = None

    @torch.no_grad()
    def anchors_to_params(self) -> None:
        """Start the next inner phase from the (new) anchor."""
        for p, a in zip(self.params, self.anchors, strict=True):
            p.copy_(a.to(p.device, p.dtype))
        self.steps = self.samples = 0

    @torch.no_grad()
    def params_to_anchors(self) -> None:
        """This peer's own parameters become the anchor (before it joins, or after a rollback)."""
        for p, a in zip(self.params, self.anchors, strict=True):
            a.copy_(p.detach().to(a.device, a.dtype))

    @torch.no_grad()
    def state_norms(self) -> dict[str, float]:
        """Sizes of the outer momentum and the inner AdamW state: zero until trained or downloaded."""
        momentum = [self.outer.state[a].get("momentum_buffer") for a in self.anchors]
        squares = self.extra_tensors[2 :: len(INNER_KEYS)]
        return {
            "outer_momentum_norm": float(
                sum(float(m.double().pow(2).sum()) for m in momentum if m is not None)
            )
            ** 0.5,
            "inner_exp_avg_sq_sum": float(sum(float(v.double().sum()) for v in squares)),
            "inner_step": float(self.extra_tensors[0]),
        }

    def pseudo_gradient_scale(self) -> float:
        """How much longer an honest peer's pseudo-gradient of this round can be than this peer's: H / the
        inner steps this peer took (at least 1). Each inner AdamW step moves the parameters by about the
        same length, so the sum of H steps is at most about H times one step's (the triangle inequality).
        A newcomer that joins a round after 1 inner step, while the others took 16, offers a pseudo-gradient
        about 16x shorter than the group's mean; the round screen (swarm/averaging/screen.py) multiplies its
        own norm by this, or it would reject that honest round. With ``round_seconds``, H is the steps that
        this peer takes in a whole round: those of its last whole phase, or what its speed gives in
        ``round_seconds``, whichever is more."""
        expected = self.local_steps if self.round_seconds <= 0 else self._steps_per_round()
        sent = self.sent_steps
        if self._flight is not None and sent > 0:
            # overlap: a groupmate keeps computing through its own rounds, and one whose last round stalled
            # offers a phase that ran from about this peer's previous launch until now (seen: 163 inner
            # steps against this peer's 17, and the honest mean rejected). At this peer's own speed:
            phase = self._flight_began - self._sent_phase_began
            if phase > 0:
                grown = time.perf_counter() - self._sent_phase_began
                expected = max(expected, int(sent * grown / phase))
        return expected / sent if 0 < sent < expected else 1.0

    def _steps_per_round(self) -> int:
        speed = float(self.opt.tracker.performance_ema.samples_per_second)
        step = self.samples / self.steps if self.steps else 1
        by_speed = int(self.round_seconds * speed / step) if speed > 1e-6 else 0
        return max(self.full_phase_steps, by_speed, 1)

    @property
    def epoch(self) -> int:
        """The global epoch of the parameters this peer trains: with a round in flight, the epoch it started
        from (the optimizer's own counter moves when the round ends in the background; the parameters follow
        only when it lands)."""
        return self._flight_epoch if self._flight is not None else self.opt.local_epoch

    def after_inner_step(self, batch_size: int) -> bool:
        """Count one inner step; run the outer step when due. True if the global epoch advanced."""
        opt = self.opt
        self.steps += 1
        self.samples += batch_size
        if self._flight is not None:  # overlap: a round is in flight; land it if it has ended
            return self._land() if self._flight.is_set() else False
        opt.tracker.report_local_progress(opt.local_epoch, self.samples)
        ready = opt.tracker.ready_to_update_epoch
        if not ready and (self.round_seconds > 0 or self.steps < self.local_steps):
            if self.match_early:
                # hivemind's own pre-scheduling: look for the group once the swarm's estimated end of the
                # phase is within matchmaking_time, so that the group is there when the phase ends
                opt._maybe_schedule_gradient_averaging()
            return False
        return self._launch() if self.overlap else self.outer_step()

    def outer_step(self) -> bool:
        """The outer round, waited for: the inner phase goes on from the new anchor."""
        epoch = self.opt.local_epoch
        self._offer()
        if not self._outer_round(epoch, self.samples):  # leaving: keep the inner progress, nothing averaged
            return False
        self._count_round()
        self.anchors_to_params()
        return True

    def _offer(self) -> None:
        """End the inner phase: its pseudo-gradient becomes the anchors' gradient."""
        self.before_outer_step()
        with torch.no_grad():
            for p, a in zip(self.params, self.anchors, strict=True):
                a.grad = a.detach() - p.detach().to(a.device, a.dtype)  # the pseudo-gradient
        self.sent_steps = self.steps

    def _outer_round(self, epoch: int, samples: int) -> bool:
        """Offer the pseudo-gradient, wait for the swarm, average and step the outer optimizer; True if the
        global epoch advanced (False: this peer is leaving)."""
        opt = self.opt
        # hivemind accumulates the pseudo-gradient (weighted by this peer's samples), reports progress, and,
        # once the swarm is ready, averages and steps the outer optimizer
        opt.step(batch_size=max(samples, 1))
        started = time.perf_counter()
        while opt.local_epoch == epoch and not self.should_stop():
            ready = opt.tracker.ready_to_update_epoch
            if ready or group_formed(opt):
                self.rounds_on_formed_group += not ready
                opt._update_global_epoch(None)  # what hivemind.Optimizer.step does once the swarm is ready
                break
            read_while_waiting(opt.tracker)
            time.sleep(0.02)
        self.waited += time.perf_counter() - started
        for a in self.anchors:
            a.grad = None
        return opt.local_epoch != epoch

    def _count_round(self) -> None:
        self.outer_steps += 1
        if self.outer_steps > 1:  # the first phase of a peer may have begun in the middle of a round
            self.full_phase_steps = self.sent_steps

    # ---- overlap: the outer round in the background -------------------------------------------------
    def _launch(self) -> bool:
        """Hand the outer round to a background thread; the inner steps go on from the current parameters."""
        epoch, samples = self.opt.local_epoch, self.samples
        self._offer()
        with torch.no_grad():
            self._phase_end = [p.detach().clone() for p in self.params]
        self._sent_samples = samples
        self.steps = self.samples = 0
        self._flight_epoch, self._flight_error = epoch, None
        self._flight_began = time.perf_counter()
        self._sent_phase_began, self._phase_began = self._phase_began, self._flight_began
        self._flight = threading.Event()
        assert self._rounds is not None
        self._rounds.put((epoch, samples, self._flight))
        return False

    @torch.no_grad()
    def _land(self) -> bool:
        """The round in flight has ended: move the parameters onto the new anchor, keeping the inner steps
        taken meanwhile; True if the global epoch advanced."""
        assert self._flight is not None
        self._flight.wait()
        self._flight = None
        self.last_flight = time.perf_counter() - self._flight_began
        self.flight_seconds += self.last_flight
        phase_end, self._phase_end = self._phase_end, []
        if self._flight_error is not None:
            error, self._flight_error = self._flight_error, None
            raise error
        opt = self.opt
        if opt.local_epoch == self._flight_epoch:  # leaving: nothing was averaged; the samples stay unsent
            self.steps, self.samples = self.steps + self.sent_steps, self.samples + self._sent_samples
            return False
        for p, a, end in zip(self.params, self.anchors, phase_end, strict=True):
            p.add_(a.to(p.device, p.dtype) - end)  # new anchor + the steps since the phase ended
        self._count_round()
        # the samples computed during the round count toward the next one, over the time they took: hivemind
        # paused its speed estimate for the round (progress_tracker.py pause_updates), as if idle
        opt.tracker.performance_ema.timestamp = self._flight_began
        opt.tracker.report_local_progress(opt.local_epoch, self.samples)
        return True

    def settle(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the round in flight, and land it (before a download or a shutdown)."""
        if self._flight is None:
            return
        if self._flight.wait(timeout):
            self._land()
