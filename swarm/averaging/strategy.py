"""HivemindStrategy: a Lightning strategy that trains one process as a peer of a hivemind swarm.

Usage from any Lightning script::

    node = swarm.net.node.start_node(SwarmConfig(initial_peers=(...,)))
    trainer = L.Trainer(strategy=HivemindStrategy(node=node, run_id="my-run", target_batch_size=4096,
                                                  batch_size=64), max_epochs=-1)
    trainer.fit(module, loader)

The strategy wraps the module's single optimizer in ``hivemind.Optimizer``. Every local step adds its
gradients to the swarm's accumulator; once the swarm has ``target_batch_size`` samples, peers average
their gradients and take one optimizer step together (one *global epoch*). Learning-rate schedulers
from ``configure_optimizers`` advance with the global epoch, not with the local step. The strategy owns
the node it is given: teardown (also after an error or Ctrl-C) shuts down the optimizer, then the node.
What the strategy changes in hivemind is in swarm/patches (installed and wired in ``_wrap_optimizer``).

AMP: ``precision="bf16-mixed"`` needs no scaler. ``precision="16-mixed"`` (CUDA) uses Lightning's standard
GradScaler, which unscales each local step's gradients before hivemind accumulates them and skips steps
whose gradients overflowed; hivemind documents this as the right scaler when ``reuse_grad_buffers`` is off,
which is how this strategy runs. Non-finite gradients are never sent to the swarm: the step is skipped.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from swarm import patches
from swarm.averaging.diloco import DiLoCo, averaged_statistics
from swarm.averaging.donors import AHEAD, DonorCheck
from swarm.averaging.guard import StateGuard, SwarmWedgedError, all_finite
from swarm.averaging.rounds import RoundClock
from swarm.averaging.screen import RoundScreen
from swarm.compression import parse_compression
from swarm.config import AVERAGING, SwarmConfig
from swarm.log import quiet_hivemind
from swarm.net.fence import MemberBook
from swarm.patches import grad_averager, matchmaking, progress, robust, traffic
from swarm.patches.optimizer import Wired, Wiring, wire
from swarm.patches.state_averager import REFUSE_FOR, state_sketch
from swarm.procs import p2p_daemon_alive
from swarm.waiting import wait_until

if TYPE_CHECKING:
    import hivemind
    import lightning.pytorch as pl

    from swarm.faults import FaultInjector
    from swarm.net.node import SwarmNode

log = logging.getLogger(__name__)
REJECTED_IN_ROW = 3  # rejected averaging rounds (of one kind) in a row that earn one louder line
REJECTED_LOG_EVERY = 50  # ... after which only every 50th is logged
NONFINITE_ROLLBACK = 10  # local steps in a row with non-finite gradients before a rollback (guard's state)
NONFINITE_GIVE_UP = 30  # ... before the peer stops: no state it has or can download trains
P2PD_EXITS_WITHIN = 0.5  # seconds a p2p daemon signalled with its peer takes to exit, at most


class GlobalEpochScheduler:
    """Wraps an LR scheduler so that it advances to the optimizer's global epoch and never beyond.

    Lightning calls ``step()`` after every local step; this wrapper steps the real scheduler only when
    hivemind has moved to a new global epoch (several times at once after loading state from peers).
    """

    def __init__(self, optimizer: hivemind.Optimizer, scheduler: Any) -> None:
        self.__dict__.update({k: v for k, v in scheduler.__dict__.items() if k not in ("step", "__del__")})
        self.optimizer, self.scheduler = optimizer, scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():  # a newcomer may jump epochs before its first local step: intended
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            while self.scheduler.last_epoch < self.optimizer.local_epoch:
                self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()


def grads_are_finite(params: list[torch.nn.Parameter]) -> bool:
    """True if every gradient of ``params`` is finite (no NaN or Inf). A list kept from set-up, not
    ``module.parameters()``: walking the module at every step was half of this check's cost (py-spy)."""
    return all_finite([p.grad for p in params if p.grad is not None])


class HivemindStrategy(SingleDeviceStrategy):
    """Train as one peer of a hivemind swarm. See the module docstring for behaviour and usage.

    Args:
        node: a started ``SwarmNode`` (from ``swarm.net.node.start_node``); the strategy stops it.
        run_id: name of the run; all peers with this run_id average with each other.
        target_batch_size: samples the swarm accumulates per global epoch (optimizer step).
        batch_size: this peer's per-step batch size.
        device: torch device for the model ('cpu', 'cuda', 'cuda:1').
        matchmaking_time: seconds to gather an averaging group; keep it above ``request_timeout``.
        averaging_timeout: cancel an all-reduce after this many seconds. Increase it if you see
            'Proceeding with local gradients' in more than a quarter of the steps.
        average_state_every: average parameters every this many global epochs.
        load_state_timeout: seconds to wait for the swarm's state when (re)joining.
        request_timeout: seconds before one averaging request counts as lost.
        next_chunk_timeout: seconds to wait for a peer's next chunk inside an all-reduce (hivemind's
            default is matchmaking_time); peers late by more are averaged without, and the swarm drifts apart.
        load_state_on_start: download the swarm's newest state before the first step.
        resume_epoch: start at this global epoch (a checkpoint's); the swarm's state still wins if newer.
        resume_optimizer_state: the optimizer's ``state_dict`` from that checkpoint (AdamW moments).
        verbose: let hivemind log its internal events at INFO level.
        faults: a FaultInjector (tests only): kills and corrupted numbers at chosen moments.
        compression: 'none', 'fp16', 'int8' or 'powersgd:<rank>' (see swarm/compression.py).
        averaging: 'gradients' (every global step averages gradients) or 'diloco' (see
        swarm/averaging/diloco.py:
            ``local_steps`` inner steps of the module's optimizer, then an outer Nesterov SGD step with
            ``outer_lr`` and ``outer_momentum`` on the averaged pseudo-gradient).
        close_groups_early: close an averaging group as soon as every peer that reports progress is in it
            (hivemind's own default waits the whole ``matchmaking_time``; see swarm/patches/matchmaking.py).
        report_every: seconds between two progress records in the DHT within a global epoch (hivemind
            stores one after every step; 0 restores that). A new epoch is reported at once.
        skip_agreed_state_rounds: skip a state round when the gradient round showed the whole swarm holding
            one state already (gradient averaging only; see docs/hivemind-patches.md item 16).
        aggregation: how this peer reduces its slices of every round: 'centered_clip' (robust) or 'mean'
            (hivemind's; see swarm/patches/robust.py).
        check_downloads: check every state downloaded from a donor against the states that the other peers
            published for its epoch, and take it from the next donor if they contradict it (see
            swarm/averaging/donors.py).
        judge_steps: also judge each gradient round by the loss after the step Adam would take on it (see
            swarm/averaging/screen.py ``judge_step``).
        download_donors: with ``check_downloads``, take a download in slices from up to this many donors at
            once (see swarm/patches/state_averager.py, item 31); 1: from one donor.
        overlap_rounds: DiLoCo: run each outer round in the background while the inner steps go on, and
            apply its result one round late (see swarm/averaging/diloco.py).
        optimizer_kwargs: passed on to ``hivemind.Optimizer``.
    """

    strategy_name = "hivemind"

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        target_batch_size: int,
        batch_size: int,
        device: str | torch.device = "cpu",
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 60.0,
        average_state_every: int = 1,
        load_state_timeout: float = 60.0,
        request_timeout: float = 3.0,
        next_chunk_timeout: float | None = None,
        load_state_on_start: bool = True,
        resume_epoch: int | None = None,
        resume_optimizer_state: dict | None = None,
        verbose: bool = False,
        faults: FaultInjector | None = None,
        compression: str = "none",
        averaging: str = "gradients",
        local_steps: int = 50,
        round_seconds: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        close_groups_early: bool = True,
        report_every: float = 0.25,
        reject_factor: float = 10.0,
        skip_agreed_state_rounds: bool = True,
        aggregation: str = "centered_clip",
        check_downloads: bool = True,
        judge_steps: bool = False,
        download_donors: int = 1,
        overlap_rounds: bool = False,
        match_early: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # Lightning's set_device needs an index
            device = torch.device("cuda", 0)
        super().__init__(device=device)
        quiet_hivemind(verbose)
        self.node, self.run_id = node, run_id
        self.target_batch_size, self.batch_size = target_batch_size, batch_size
        self.load_state_on_start, self.request_timeout = load_state_on_start, request_timeout
        self.hivemind_opt: hivemind.Optimizer | None = None
        self.skipped_nonfinite_steps = 0
        self.nonfinite_rollbacks = 0  # global epochs after which the parameters were non-finite
        self.resyncs = 0  # state downloads after a fault
        self.astray_resyncs = 0  # of them, after this peer's own state was found astray from the swarm's
        self.local_fallback_steps = 0  # failed gradient rounds: this peer stepped on its own gradient
        self.silent_rounds = 0  # gradient rounds that counted peers did not come to: those left out (item 30)
        self.close_groups_early, self.report_every = close_groups_early, report_every
        self.skip_agreed_state_rounds = skip_agreed_state_rounds
        self.agreed_state_rounds = 0  # state rounds skipped because the swarm held one state already
        self.aggregation = aggregation  # how this peer reduces its slices of rounds (swarm/patches/robust.py)
        self.screen = RoundScreen(reject_factor)  # judges every averaged result (swarm/averaging/screen.py)
        self.screen.probe = self._probe_loss
        self.screen.judge_steps = judge_steps
        self._latest_batch: tuple[Any, int] | None = None  # (the batch, the thread that trained on it)
        # the latest batch of an earlier epoch, (batch, thread): it is in none of this epoch's gradients
        self._held_out_batch: tuple[Any, int] | None = None
        self._latest_epoch = -1  # the epoch of the latest batch
        # checks every downloaded state against the swarm's (swarm/averaging/donors.py); refused downloads
        own = node.dht.peer_id.to_base58()
        self.donor_check = DonorCheck(node.dht, run_id, own, node.invite) if check_downloads else None
        # invite-only: the progress records count under the PeerIDs their signers' member records name
        self.member_book = MemberBook(node.dht, node.invite) if node.invite is not None else None
        self.refused_downloads = 0
        self.download_donors = download_donors
        self._nonfinite_in_row = 0  # local steps in a row with non-finite gradients
        self.clock: RoundClock | None = None
        self._wired: Wired | None = None  # what swarm/patches/optimizer.py hung on the optimizer
        self._group_sizes: dict[int, int | None] = {}  # the target group size last sent to each averager
        # wall time of the optimizer steps that ended a global epoch: waiting for the other peers' samples,
        # matchmaking, the all-reduce and the update (the part of a round that is not this peer's compute)
        self.round_end_seconds = 0.0
        self.faults, self.guard = faults, None
        if averaging not in AVERAGING:
            raise MisconfigurationException(
                f"averaging must be one of {', '.join(AVERAGING)}, got {averaging!r}"
            )
        self.compression = parse_compression(compression)
        self.averaging = averaging
        self._diloco_args = dict(
            local_steps=local_steps,
            round_seconds=round_seconds,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            overlap=overlap_rounds,
            match_early=match_early,
        )
        self.diloco: DiLoCo | None = None
        self.loaded_epoch: int | None = None
        self.resume_epoch, self.resume_optimizer_state = resume_epoch, resume_optimizer_state
        self._optimizer_kwargs = dict(
            matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout,
            average_state_every=average_state_every,
            load_state_timeout=load_state_timeout,
            next_chunk_timeout=next_chunk_timeout,
            delay_state_averaging=False,
            # to the state averager only; peers that average their state take the group's newest epoch, and
            # look for their state group for at most twice matchmaking_time (docs/hivemind-patches.md item 12)
            averager_opts={
                "request_timeout": request_timeout,
                "sync_epoch_when_averaging": True,
                "find_group_within": min(2 * matchmaking_time, averaging_timeout),
            },
            verbose=verbose,
            **optimizer_kwargs,
        )
        self._shut_down = False
        self.leaving = False  # set when the peer was asked to leave (a signal): shutdown is then bounded
        self.leave_timeout = 3.0

    @classmethod
    def from_swarm_config(
        cls, swarm: SwarmConfig, *, node: SwarmNode, batch_size: int, **kwargs: Any
    ) -> HivemindStrategy:
        """The strategy with every averaging setting taken from ``swarm`` (``kwargs`` add or override)."""
        fields = dict(
            run_id=swarm.run_id,
            target_batch_size=swarm.target_batch_size,
            matchmaking_time=swarm.matchmaking_time,
            averaging_timeout=swarm.averaging_timeout,
            average_state_every=swarm.average_state_every,
            load_state_timeout=swarm.load_state_timeout,
            request_timeout=swarm.request_timeout,
            next_chunk_timeout=swarm.next_chunk_timeout,
            compression=swarm.compression,
            averaging=swarm.averaging,
            local_steps=swarm.local_steps,
            round_seconds=swarm.round_seconds,
            outer_lr=swarm.outer_lr,
            outer_momentum=swarm.outer_momentum,
            close_groups_early=swarm.close_groups,
            report_every=swarm.report_every,
            reject_factor=swarm.reject_factor,
            skip_agreed_state_rounds=swarm.skip_agreed_state_rounds,
            aggregation=swarm.aggregation,
            check_downloads=swarm.check_downloads,
            judge_steps=swarm.judge_steps,
            download_donors=swarm.download_donors,
            overlap_rounds=swarm.overlap_rounds,
            match_early=swarm.match_early,
        )
        return cls(node=node, batch_size=batch_size, **{**fields, **kwargs})

    # ---- properties that roles and callbacks read -------------------------------------------------
    @property
    def local_epoch(self) -> int:
        """This peer's global epoch (number of swarm optimizer steps it has taken part in); with a DiLoCo
        round in the background, the epoch of the parameters it trains until that round lands."""
        if self.hivemind_opt is None:
            return 0
        return self.diloco.epoch if self.diloco is not None else self.hivemind_opt.local_epoch

    def state_sketch(self) -> list[float] | None:
        """The sketch of the state this peer serves to newcomers now (its parameters as the state averager
        holds them; DiLoCo's anchors), for the other peers' download checks (swarm/averaging/donors.py)."""
        if self.hivemind_opt is None:
            return None
        averager = self.hivemind_opt.state_averager
        with averager.lock_averaged_tensors:
            params = [p for g in averager.optimizer.param_groups for p in g["params"]]
            if averager.serve_filter is not None:  # the bad_donor fault: what it serves (swarm/faults.py)
                params = averager.serve_filter([p.detach().cpu() for p in params], averager.local_epoch)
            return state_sketch(params)

    @property
    def bytes_sent(self) -> float:
        """Bytes this process has sent in averaging rounds (swarm/patches/traffic.py)."""
        return traffic.bytes_sent()

    def meet_peers(self, count: int, stop: Any, within: float = 10.0) -> int:
        """Peers started together (``--min-peers``): before the first step, until this peer's progress
        tracker sees ``count`` peers (swarm/patches/progress.py ``meet_peers``); returns how many it sees."""
        if self.hivemind_opt is None or count <= 1:
            return 1
        return progress.meet_peers(self.hivemind_opt.tracker, count, stop, within)

    # ---- Lightning hooks --------------------------------------------------------------------------
    def on_train_start(self) -> None:
        # after the callbacks' on_train_start (the volunteer's wait for peers and first validation), right
        # before the first step: hivemind's speed estimate times its first samples from when the tracker was
        # made, so start-up made the first speed a few samples/s and the swarm's first estimate of the time to
        # the target 25 s (docs/hivemind-patches.md item 14)
        super().on_train_start()
        if self.hivemind_opt is not None:
            self.hivemind_opt.tracker.performance_ema.reset_timer()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit":
            self._wrap_optimizer()

    def _wrap_optimizer(self) -> None:
        import hivemind

        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"HivemindStrategy needs exactly one optimizer, got {len(self.optimizers)}"
            )
        if self.resume_optimizer_state is not None:
            try:
                self.optimizers[0].load_state_dict(self.resume_optimizer_state)
            except (ValueError, KeyError) as exc:
                raise MisconfigurationException(
                    f"the checkpoint's optimizer state does not fit: {exc}"
                ) from None
        # before hivemind starts its averager processes (they fork with the classes as they are then)
        patches.install()
        robust.use(self.aggregation)
        self.node.fence_averagers()  # invite-only: fenced averagers (a no-op if the role did it, or open)
        inner = self.optimizers[0]
        # DiLoCo's inner steps reach the swarm only through the outer step, where the guard checks once
        params = [p for group in inner.param_groups for p in group["params"]]
        self.guard = StateGuard(params, inner, each_step=self.averaging != "diloco")
        factory = self._grad_averager_factory()
        if self.averaging == "diloco":
            # hivemind's optimizer runs the outer SGD on the anchors; the module's optimizer stays local
            self.diloco = DiLoCo(
                inner,
                **self._diloco_args,
                should_stop=lambda: self.leaving,
                before_outer_step=self.guard.undo_nonfinite_update,
            )
            swarm_optimizer, extra_tensors = self.diloco.outer, self.diloco.extra_tensors
        else:
            swarm_optimizer, extra_tensors = inner, ()
        sigint = signal.getsignal(signal.SIGINT)  # hivemind's averagers set SIGINT to SIG_IGN in this process
        optimizer_kwargs = dict(self._optimizer_kwargs)
        # hivemind 1.1.12 never takes client_mode from the DHT (optim/optimizer.py:205 tests `is None` the
        # wrong way round), so a client-mode peer's Optimizer thought itself a full peer and died at its first
        # global epoch ("State sharing priority is unused: averager in client mode cannot share its state")
        optimizer_kwargs.setdefault("client_mode", self.node.client_mode)
        # DiLoCo's inner moments: each peer's own, out of the state rounds (hivemind-patches.md item 40)
        own_extras = {"own_extras": True} if self.diloco is not None else {}
        optimizer_kwargs["averager_opts"] = {**(optimizer_kwargs.get("averager_opts") or {}), **own_extras}
        self.hivemind_opt = hivemind.Optimizer(
            dht=self.node.dht,
            run_id=self.run_id,
            optimizer=swarm_optimizer,
            extra_tensors=extra_tensors,
            target_batch_size=self.target_batch_size,
            batch_size_per_step=self.batch_size,
            # hivemind passes averager_opts to the state averager only; the gradient averager needs the
            # same request_timeout, or matchmaking_time below 3 s risks deadlocks
            grad_averager_factory=factory,
            average_opt_statistics=averaged_statistics(swarm_optimizer),
            **self.compression.optimizer_kwargs(),
            **optimizer_kwargs,
        )
        if self.diloco is not None:
            self.diloco.attach(self.hivemind_opt)
        self._wired = wire(
            self.hivemind_opt,
            Wiring(
                update_optimizer=swarm_optimizer,
                diloco=self.diloco is not None,
                round_seconds=self.diloco.round_seconds if self.diloco is not None else 0.0,
                report_every=self.report_every,
                screen=self.screen,
                on_rejected=self._on_rejected_round,
                own_scale=None if self.diloco is None else self.diloco.pseudo_gradient_scale,
                instrument=lambda opt: RoundClock(opt, swarm_optimizer),
                on_strangers=self._on_strangers,
                on_screened_state=self._on_screened_state,
                skip_agreed_state_rounds=self.skip_agreed_state_rounds,
                on_agreed=self._on_agreed_state,
                on_local_fallback=self._on_local_fallback,
                alone_grace=2 * self._optimizer_kwargs["matchmaking_time"],
                on_silent=self._on_silent_peers,
                check_download=self.donor_check,
                download_donors=self.download_donors,
                on_refused=self._on_refused_download,
                members=self.member_book,
            ),
        )
        self.clock = self._wired.instrument
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)  # so that Ctrl-C still reaches this process
        for config in self.lr_scheduler_configs:
            if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise MisconfigurationException("ReduceLROnPlateau is not supported by HivemindStrategy")
            config.scheduler = GlobalEpochScheduler(self.hivemind_opt, config.scheduler)  # type: ignore[assignment]
        self.optimizers = [self.hivemind_opt] if self.diloco is None else [inner]
        if self.resume_epoch:
            self._start_at_epoch(self.resume_epoch)
        self.guard.save(self.local_epoch)  # this peer's own (initial or resumed) state, as a fallback
        if self.load_state_on_start:
            self.load_state_from_peers()
            if self.guard.finite():
                self.guard.save(self.local_epoch)
            else:
                self._restore_guarded()
                log.error("The swarm's state is non-finite; starting from this peer's own parameters instead")
        if self.faults is not None:
            self.faults.start(self.local_epoch)

    def _grad_averager_factory(self) -> Any:
        """The gradient averager for hivemind.Optimizer: hivemind's (PowerSGD's for ``powersgd``) with
        swarm/patches/grad_averager.py's changes, and the fault injector's kill hooks in fault tests."""
        from hivemind.optim.grad_averager import GradientAverager

        grad_kwargs: dict[str, Any] = dict(request_timeout=self.request_timeout)
        if self.compression.mode != "powersgd":
            # Nobody downloads a plain gradient averager's state (hivemind.Optimizer fetches it after the
            # state averager's and drops it, optimizer.py:697), yet as a donor it stored a declaration in
            # the DHT at every global epoch: 4 of the 30 DHT requests a second of a scaling-bench peer.
            # PowerSGD's averager shares its Q buffers that way and keeps doing so.
            grad_kwargs["allow_state_sharing"] = False
        if self.faults is None:
            return grad_averager.round_averager(
                self.compression.grad_averager_factory(GradientAverager, **grad_kwargs)
            )
        if self.compression.mode == "powersgd":
            raise MisconfigurationException("fault injection cannot be combined with powersgd compression")
        return self.faults.grad_averager_factory(
            grad_averager.keeping_local_gradients(GradientAverager), **grad_kwargs
        )

    def _start_at_epoch(self, epoch: int) -> None:
        """Make this peer's optimizer (and what it announces to the swarm) start at global epoch ``epoch``."""
        opt = self.hivemind_opt
        assert opt is not None
        opt.state_averager.local_epoch = epoch
        with opt.tracker.pause_updates():
            opt.tracker.update_epoch(epoch)
        if not opt.client_mode:
            opt.state_averager.state_sharing_priority = epoch
        log.info("Resuming at global epoch %d from the checkpoint", epoch)

    def load_state_from_peers(self) -> None:
        """Download the newest parameters and optimizer state from the swarm (no-op if alone)."""
        assert self.hivemind_opt is not None
        if self.diloco is not None:
            self.diloco.settle()  # a round in the background lands first: the download replaces its result
        before = self.hivemind_opt.local_epoch
        self.hivemind_opt.load_state_from_peers()
        if self.diloco is not None:
            self.diloco.anchors_to_params()  # the swarm's anchor is where the next inner phase starts
            if self.diloco.loaded is None:
                self.diloco.loaded = self.diloco.state_norms()
        self.loaded_epoch = self.hivemind_opt.local_epoch
        # item 25: whether a donor's state arrived and stands (hivemind's download returns quietly otherwise)
        answered = getattr(self.hivemind_opt.state_averager, "donor_answered", True)
        tracker = self.hivemind_opt.tracker
        others = tracker.global_progress.num_peers > 1
        if not answered and tracker.global_epoch > self.loaded_epoch:
            log.warning(
                "No donor sent a state that this peer could take (too slow, gone, or refused); the swarm is "
                "at global epoch %d, this peer trains from its own parameters at %d until its next download",
                tracker.global_epoch,
                self.loaded_epoch,
            )
        elif self.loaded_epoch != before or others:
            log.info("Loaded the swarm's state from peers: global epoch %d", self.loaded_epoch)
        else:
            log.info(
                "No peer had newer state; starting from this peer's own parameters (global epoch %d)", before
            )
        for config in self.lr_scheduler_configs:
            config.scheduler.step()

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        module = model if isinstance(model, torch.nn.Module) else self.lightning_module
        epoch = self.local_epoch
        self._match_group_size()
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            began = time.perf_counter()  # here the step includes the closure (forward and backward)
            result = super().optimizer_step(optimizer, closure, model, **kwargs)  # the scaler skips inf steps
        else:
            result = closure()
            began = time.perf_counter()
            if self.faults is not None:
                self.faults.corrupt_gradients(module, epoch)
            if not grads_are_finite(self.guard.params):  # the optimizer's parameters: all that is sent
                self._skip_nonfinite_step(module)
                return result
            self._nonfinite_in_row = 0
            result = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        if self.diloco is not None:
            self.diloco.after_inner_step(self.batch_size)  # the outer step, when due
        if self.local_epoch != epoch:
            spent = time.perf_counter() - began
            self.round_end_seconds += spent
            if self.clock is not None:
                flight = self.diloco.last_flight if self.diloco is not None and self.diloco.overlap else 0.0
                self.clock.close_round(self.local_epoch, spent, flight, self.screen.take_state_away())
            self._after_global_step(module)
            if self.screen.take_far_state():
                self._check_own_state()
        if self.faults is not None and self.hivemind_opt is not None:
            accumulated = (
                self.diloco.samples
                if self.diloco is not None
                else self.hivemind_opt.grad_averager.local_samples_accumulated
            )
            self.faults.on_local_step(self.local_epoch, accumulated)
        return result

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step; the batch is kept for the screen's probe (``_probe_loss``), and the
        latest batch of the epoch before as the held-out one."""
        batch = args[0] if args else kwargs.get("batch")
        epoch = self.local_epoch
        if epoch != self._latest_epoch and self._latest_batch is not None:
            self._held_out_batch = self._latest_batch
        self._latest_batch = (batch, threading.get_ident()) if batch is not None else None
        self._latest_epoch = epoch
        return super().training_step(*args, **kwargs)

    def _probe_loss(
        self, mine: list[torch.Tensor], *candidates: list[torch.Tensor], held_out: bool = False
    ) -> tuple[float, ...] | None:
        """The loss of this peer's latest training batch (``held_out``: the latest of an earlier epoch, whose
        gradient is in no gradient of this epoch) with its own parameters ``mine``, then with each of
        ``candidates`` in their place (the screen's ``Probe``), or None where it cannot be asked: no batch
        yet, a module without ``batch_loss``, tensors that are not the module's own (an offloaded optimizer's
        copies), or a thread other than the training one (the parameters are swapped in place)."""
        module = self.lightning_module
        loss_of = getattr(module, "batch_loss", None)
        kept = self._held_out_batch if held_out else self._latest_batch
        if kept is None or loss_of is None:
            return None
        batch, thread = kept
        own = {id(p) for p in module.parameters()}
        if thread != threading.get_ident() or not mine or any(id(t) not in own for t in mine):
            return None
        training = module.training
        module.eval()
        saved = [t.data for t in mine]
        try:
            # as the training step ran it: the precision's input conversion and autocast
            batch = self.precision_plugin.convert_input(batch)
            with torch.no_grad(), self.precision_plugin.train_step_context():
                losses = [float(loss_of(batch))]
                for theirs in candidates:
                    for tensor, new in zip(mine, theirs, strict=True):
                        tensor.data = new.detach().to(tensor.device, tensor.dtype)
                    losses.append(float(loss_of(batch)))
        except Exception as exc:  # a probe that cannot run judges nothing; training goes on
            log.debug("The screen's probe failed: %r", exc)
            return None
        finally:
            for tensor, old in zip(mine, saved, strict=True):
                tensor.data = old
            module.train(training)
        return tuple(losses)

    def _match_group_size(self) -> None:
        """Let averaging groups close as soon as every peer the tracker sees is in
        (swarm/patches/matchmaking.py)."""
        opt = self.hivemind_opt
        if opt is None or not self.close_groups_early:
            return
        size = max(2, opt.tracker.global_progress.num_peers)
        for averager in self._averagers():
            matchmaking.set_target_group_size(averager, size, self._group_sizes)

    def _on_local_fallback(self, samples: int) -> None:
        self.local_fallback_steps += 1
        log.warning(
            "The gradient round toward global epoch %d failed; this peer steps on its own gradient of %d "
            "samples instead (%d such steps so far). Parameters realign at the next state averaging.",
            self.local_epoch + 1,
            samples,
            self.local_fallback_steps,
        )

    def _on_silent_peers(self, count: int, came: int) -> None:
        self.silent_rounds += 1
        self._match_group_size()  # before the epoch's state round looks for its group
        log.info(
            "%d counted peer(s) did not come to the gradient round toward global epoch %d (%s): they left or "
            "fell behind, and count again once they report progress",
            count,
            self.local_epoch + 1,
            f"a group of {came}" if came else "no group formed",
        )

    def _on_agreed_state(self, epoch: int, group: int) -> None:
        self.agreed_state_rounds += 1
        if self.clock is not None:
            self.clock.agreed = True
        log.debug("The %d peers of global epoch %d's round hold one state: no state round", group, epoch)

    def _on_screened_state(self, epoch: int, reason: str) -> None:
        log.info(
            "This peer rejected the gradient round toward global epoch %d, so it skips the epoch's state "
            "round and keeps its own state (groupmates that own a round's gradient own its state round too)",
            epoch,
        )

    def _on_strangers(self, epoch: int, strangers: frozenset) -> None:
        log.info(
            "%d groupmate(s) of the gradient round toward global epoch %d never learnt of the group; this "
            "peer skips the epoch's state round and meets them in the next gradient round",
            len(strangers),
            epoch,
        )

    def _on_refused_download(self, donor: str, reason: str) -> None:
        """A downloaded state was refused (docs/hivemind-patches.md item 23): say so; the next donor is
        asked. A state whose epoch no other peer has reached cannot be checked yet (an honest peer ahead of
        the others while a swarm starts, or a donor that claims a future epoch): said as news, since nothing
        is wrong with this peer; a state that other peers contradict is a warning."""
        self.refused_downloads += 1
        log.log(
            logging.INFO if AHEAD in reason else logging.WARNING,
            "Refused the state downloaded from peer %s: %s. This peer keeps its own state, asks the next "
            "donor, and does not ask that one again for %.0f s",
            donor,
            reason,
            REFUSE_FOR,
        )

    def _on_rejected_round(self, kind: str, reason: str, samples: int) -> None:
        """The screen refused an averaged result (docs/hivemind-patches.md item 7): say so, with the figure
        (the first rounds of a run of rejections, then every REJECTED_LOG_EVERY-th: an attacker may stay
        long)."""
        if self.clock is not None:
            self.clock.rejected.append(kind)
        row = self.screen.in_row[kind]
        if row <= REJECTED_IN_ROW or row % REJECTED_LOG_EVERY == 0:
            if kind == "gradient":
                what, instead = (
                    "the gradient averaging round",
                    f"steps on its own gradient of {samples} samples",
                )
            elif kind == "state":
                what, instead = "the state averaging round", "keeps its own state"
            else:
                what, instead = "the state downloaded from peers", "keeps its own state and takes their epoch"
            # a lone gradient round rejected by its step alone: news (1 honest round in 100 to 200 is)
            lone_step = kind == "gradient" and self.screen.by_step and row == 1
            log.log(
                logging.INFO if lone_step else logging.WARNING,
                "Rejected %s toward global epoch %d: %s; this peer %s instead (%d in a row, %d rejected "
                "so far)",
                what,
                self.local_epoch + 1,
                reason,
                instead,
                row,
                self.screen.rejected,
            )
        if row == REJECTED_IN_ROW:
            log.error(
                "%d %s results in a row were rejected: a peer of this swarm sends outsized updates (an "
                "attack or a bug). This peer keeps training on its own results, rejects each such one, and "
                "logs every %dth from now on.",
                row,
                kind,
                REJECTED_LOG_EVERY,
            )

    def _skip_nonfinite_step(self, module: torch.nn.Module) -> None:
        """Drop this step's gradients (never sent). The first bad step of a run resynchronises with the
        swarm; NONFINITE_ROLLBACK bad steps in a row roll back to the last state that passed the checks;
        NONFINITE_GIVE_UP in a row stop the peer with one line (it never spins, and never logs forever)."""
        assert self.guard is not None
        self.skipped_nonfinite_steps += 1
        self._nonfinite_in_row += 1
        module.zero_grad(set_to_none=True)
        row = self._nonfinite_in_row
        if row <= 3 or row in (NONFINITE_ROLLBACK, NONFINITE_GIVE_UP):
            log.warning(
                "Skipping a step with non-finite gradients (%d so far, %d in a row); nothing was sent to the "
                "swarm",
                self.skipped_nonfinite_steps,
                row,
            )
        if row == 1:
            self._resync("after a step with non-finite gradients")
        elif row == NONFINITE_ROLLBACK:
            with self.hivemind_opt.state_averager.lock_averaged_tensors:
                self._restore_guarded()
            self.nonfinite_rollbacks += 1
            log.error(
                "%d steps in a row gave non-finite gradients, also after reloading the swarm's state; rolled "
                "back to this peer's last good state (global epoch %s)",
                row,
                self.guard.epoch,
            )
        elif row >= NONFINITE_GIVE_UP:
            raise SwarmWedgedError(
                f"{row} training steps in a row gave non-finite gradients, even after reloading the swarm's "
                f"state and rolling back to global epoch {self.guard.epoch}: no good state is left. Check "
                "the data and the learning rate, or restart from a checkpoint with --resume-from."
            )

    def _after_global_step(self, module: torch.nn.Module) -> None:
        """After each global step: keep the state if finite, else roll back and reload from peers."""
        assert self.guard is not None
        assert self.hivemind_opt is not None
        # under the averager's lock: a newcomer downloading our state never gets it half restored
        with self.hivemind_opt.state_averager.lock_averaged_tensors:
            if self.faults is not None:
                self.faults.corrupt_parameters(module, self.local_epoch)
                self.faults.serve_bad_state(self.hivemind_opt.state_averager, self.local_epoch)
                self.faults.send_bad_state(self.hivemind_opt, self.local_epoch)
                self.faults.claim_epochs(self.hivemind_opt.tracker, self.local_epoch)
            if self.guard.finite():
                self.guard.save(self.local_epoch)
                return
            self._restore_guarded()
        self.nonfinite_rollbacks += 1
        log.error(
            "The parameters are non-finite after global epoch %d; rolled back to the state of global epoch "
            "%s, reloading the swarm's state from peers",
            self.local_epoch,
            self.guard.epoch,
        )
        self._resync("after non-finite parameters")

    def _check_own_state(self) -> None:
        """A state round was rejected for its distance from this peer's parameters: if the swarm's published
        sketches show this peer's own state to be the one astray (swarm/averaging/donors.py ``astray``), take
        the swarm's (a checked download); else keep it (groupmates that own the group sent other numbers)."""
        if self.donor_check is None:
            return
        sketch = self.state_sketch()
        reason = None if sketch is None else self.donor_check.astray(self.local_epoch, sketch)
        if reason is None:
            return
        self.astray_resyncs += 1
        log.warning(
            "This peer's state is astray from the swarm's: %s. It takes the swarm's state rather than reject "
            "every round",
            reason,
        )
        self._resync("after its state went astray")

    def _restore_guarded(self) -> None:
        """Back to the last finite state (in DiLoCo also as the anchor)."""
        assert self.guard is not None
        self.guard.restore()
        if self.diloco is not None:
            self.diloco.params_to_anchors()

    def _resync(self, why: str) -> None:
        """Load the swarm's newest state; keep (or restore) the last finite one if that state is bad."""
        assert self.guard is not None and self.hivemind_opt is not None
        self.resyncs += 1
        log.info("Resynchronising with the swarm %s", why)
        self.hivemind_opt.state_averager.holds_own_state = False  # a whole state: its own may be what failed
        self.load_state_from_peers()
        if self.guard.finite():
            self.guard.save(self.local_epoch)
        else:
            self._restore_guarded()
            log.error(
                "The state received from peers is non-finite too; keeping global epoch %s's", self.guard.epoch
            )

    def _averagers(self) -> list:
        opt = self.hivemind_opt
        if opt is None:
            return []
        return [opt.state_averager] + ([opt.grad_averager] if opt.grad_averager is not None else [])

    def shutdown(self) -> None:
        """Stop the hivemind optimizer (its averagers) and the DHT with its p2p daemon. Idempotent.

        If a signal sent to the whole process group already stopped the averagers, only what is still
        alive is stopped (hivemind's own shutdown would log spurious tracebacks for the dead ones).
        """
        if self._shut_down:
            return
        self._shut_down = True
        if self.guard is not None:
            self.guard.close()
        if self.diloco is not None:  # a round in the background: waited for as hivemind's own shutdown does
            wait = self.leave_timeout if self.leaving else self._optimizer_kwargs["averaging_timeout"]
            before = self.diloco.epoch
            try:
                self.diloco.settle(wait)
            except Exception as exc:  # the round failed in the background: nothing left to keep from it
                log.info("The last outer round ended with %r", exc)
            if self.clock is not None and self.diloco.epoch != before:
                self.clock.close_round(self.diloco.epoch, 0.0, self.diloco.last_flight)
            self.diloco.detach()
        if self.clock is not None:
            self.clock.close()
        if self._wired is not None:
            self._wired.remove()
        network_alive = p2p_daemon_alive()
        if network_alive and self.leaving:
            # a signal to the whole process group (Ctrl-C in a terminal, the notebook's stop button) reached
            # p2pd too, and it takes a moment to exit: a graceful shutdown begun meanwhile loses the daemon
            # half-way, and each averager printed a traceback (FileNotFoundError for its control socket)
            network_alive = not wait_until(
                lambda: not p2p_daemon_alive(), timeout=P2PD_EXITS_WITHIN, interval=0.02
            )
        try:
            opt = self.hivemind_opt
            if opt is not None:
                averagers = self._averagers()
                if network_alive and all(a.is_alive() for a in averagers):
                    # hivemind waits for an averaging round in flight (up to averaging_timeout); a peer that
                    # was asked to leave (SIGTERM before a spot reclaim) waits only leave_timeout for it
                    if not self._graceful_shutdown(opt, self.leave_timeout if self.leaving else None):
                        log.info("Still waiting for an averaging round; stopping the averagers directly")
                        _terminate(averagers)
                else:  # a signal to the whole group stopped p2pd or the averagers: no one to say goodbye to
                    log.info("The p2p daemon or the averagers already exited; stopping the rest directly")
                    _terminate(averagers)
        finally:
            # an interrupted shutdown leaves averagers that still need the p2p daemon to say goodbye: stop
            # them first, or each prints a traceback once the daemon is gone
            _terminate(self._averagers())
            log.info("Shutting down the DHT and p2p daemon")
            self.node.stop(network_alive)

    @staticmethod
    def _graceful_shutdown(opt: hivemind.Optimizer, timeout: float | None) -> bool:
        """hivemind's own shutdown (goodbye, final averaging), bounded by ``timeout``; True if it finished."""
        if timeout is None:
            opt.shutdown()
            return True
        done = threading.Event()

        def run() -> None:
            try:
                opt.shutdown()
            except Exception as exc:  # the averagers may be terminated under it
                log.debug("hivemind's shutdown ended with %r", exc)
            finally:
                done.set()

        threading.Thread(target=run, name="hivemind-shutdown", daemon=True).start()
        return done.wait(timeout)

    def teardown(self) -> None:
        self.shutdown()
        super().teardown()


def _terminate(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(5)


def lr_of(optimizer: Any) -> float:
    """Current learning rate of the first parameter group (NaN if unknown)."""
    try:
        return float(optimizer.param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError):
        return math.nan
