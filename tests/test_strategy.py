"""HivemindStrategy in-process with a real DHT and p2p daemon on 127.0.0.1: the LR follows the global epoch,
non-finite gradients are never applied, and teardown stops the optimizer and the DHT."""

from __future__ import annotations

import math
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from swarm.averaging.guard import StateGuard, SwarmWedgedError
from swarm.averaging.strategy import HivemindStrategy
from swarm.config import build_config
from swarm.faults import FaultInjector, parse_faults
from swarm.net.node import start_node
from swarm.procs import remove_stale_sockets
from swarm.training.data import build_datasets, train_loader
from swarm.training.model import SwarmClassifier, lr_lambda


class Recorder(L.Callback):
    def __init__(self, strategy: HivemindStrategy) -> None:
        self.strategy, self.seen = strategy, []

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        self.seen.append((self.strategy.local_epoch, trainer.optimizers[0].param_groups[0]["lr"]))


class NanOnce(SwarmClassifier):
    """Returns a NaN loss on the third step, as a bug or bad data would."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


def _fit(
    module_cls,
    steps: int,
    precision: str = "32-true",
    device: str = "cpu",
    faults: str | None = None,
    built: list | None = None,
    callbacks: tuple = (),
    target_batch_size: int = 64,
    **strategy_kwargs,
):
    cfg = build_config(
        "demo", {"target_batch_size": 64, "batch_size": 32, "limit_train_samples": 512}, environ={}
    )
    started = time.time()
    node = start_node(cfg.swarm)
    strategy = HivemindStrategy(
        node=node,
        run_id="pytest-strategy",
        target_batch_size=target_batch_size,
        batch_size=32,
        device=device,
        matchmaking_time=2.0,
        request_timeout=1.5,
        averaging_timeout=10.0,
        faults=FaultInjector(parse_faults(faults)) if faults else None,
        **strategy_kwargs,
    )
    if built is not None:
        built.append(strategy)
    recorder = Recorder(strategy)
    module = module_cls(cfg.model, cfg.train)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if device == "cuda" else "cpu",
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder, *callbacks],
        use_distributed_sampler=False,
    )
    train, _ = build_datasets(cfg.data, cfg.model.img_size)
    try:
        trainer.fit(module, train_loader(train, cfg.data, seed=0))
    finally:
        strategy.shutdown()
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)
    return cfg, strategy, recorder, module, node.dht


def test_lr_follows_the_global_epoch_and_teardown_stops_everything():
    cfg, strategy, recorder, _, dht = _fit(SwarmClassifier, steps=8)
    # alone, target 64 with batch 32: a global epoch every second local step
    assert strategy.local_epoch == 4, recorder.seen
    schedule = lr_lambda(cfg.train.warmup_epochs, cfg.train.schedule_epochs)
    for epoch, lr in recorder.seen:
        assert math.isclose(lr, cfg.train.lr * schedule(epoch), rel_tol=1e-6), (epoch, lr)
    assert len({lr for _, lr in recorder.seen}) >= 3  # it really moved, once per global epoch
    assert not dht.is_alive()
    assert not strategy.hivemind_opt.state_averager.is_alive()
    # newcomers download the state averager's state; the gradient averager is no donor (hivemind would make
    # it one, store a DHT declaration at every epoch and have each newcomer download its gradient buffers)
    assert strategy.hivemind_opt.state_averager.allow_state_sharing
    assert not strategy.hivemind_opt.grad_averager.allow_state_sharing


def test_nonfinite_gradients_are_skipped_not_sent():
    _, strategy, _, module, _ = _fit(NanOnce, steps=8)
    assert strategy.skipped_nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert strategy.local_epoch == 3  # 7 good batches of 32 toward a target of 64: the NaN one did not count


def test_injected_faults_are_skipped_or_rolled_back():
    # two Inf-gradient steps from epoch 1, then NaN parameters right after the step that ends epoch 3
    _, strategy, _, module, _ = _fit(SwarmClassifier, steps=10, faults="inf_grad@1x2,nan_params@3")
    assert strategy.skipped_nonfinite_steps == 2
    assert strategy.nonfinite_rollbacks == 1
    assert strategy.resyncs == 2  # one after the run of bad gradients, one after the bad parameters
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert strategy.local_epoch == 4  # 8 good batches of 32 toward a target of 64


def test_a_peer_whose_every_step_is_nonfinite_rolls_back_then_stops_with_one_line():
    """Non-finite gradients from global epoch 1 on, every step: the first bad step resynchronises, the 10th
    rolls back to the last good state, the 30th stops the peer with one line instead of spinning."""
    built: list[HivemindStrategy] = []
    with pytest.raises(SwarmWedgedError) as caught:
        _fit(SwarmClassifier, steps=100, faults="nan_grad@1x1000", built=built)
    assert str(caught.value).startswith("30 training steps in a row gave non-finite gradients, even after")
    assert "--resume-from" in str(caught.value) and "\n" not in str(caught.value)
    (strategy,) = built
    assert strategy.skipped_nonfinite_steps == 30 and strategy.local_epoch == 1
    assert strategy.resyncs == 1 and strategy.nonfinite_rollbacks == 1
    assert strategy.guard.finite()


def test_guard_undoes_a_local_update_that_overflows():
    layer = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=1e38, momentum=0.9)
    guard = StateGuard(list(layer.parameters()), opt)
    layer(torch.ones(1, 4)).sum().backward()
    opt.step()  # finite: lr * grad stays below float32's max
    guard.save(epoch=1)
    before = [p.detach().clone() for p in layer.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in layer.parameters()]
    layer(torch.ones(1, 4) * 1e6).sum().backward()
    opt.step()  # overflows to Inf; the post-step hook puts the saved state back at once
    assert guard.rollbacks == 1 and guard.finite()
    for p, b, m in zip(layer.parameters(), before, momentum, strict=True):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["momentum_buffer"], m)
    with pytest.raises(ValueError, match="kill:allreduce"):
        parse_faults("kill:everything@3")
    (flip,) = parse_faults("flip_grad:4@+2x9")
    assert (flip.kind, flip.scale, flip.epoch, flip.count, flip.relative) == ("flip_grad", -4.0, 2, 9, True)


def test_random_gradients_keep_each_tensors_norm_and_lose_its_direction():
    """The attack bench's ``random_grad``: per parameter a random direction of the honest gradient's norm."""
    torch.manual_seed(0)  # fixed draws: a 32-number bias could point near its gradient by chance
    layer = torch.nn.Linear(64, 32)
    layer(torch.randn(8, 64)).pow(2).sum().backward()
    honest = [p.grad.clone() for p in layer.parameters()]
    injector = FaultInjector(parse_faults("random_grad@3x2"))
    assert not injector.corrupt_gradients(layer, epoch=2)  # not yet due
    assert all(torch.equal(p.grad, h) for p, h in zip(layer.parameters(), honest, strict=True))
    for _ in range(2):
        assert injector.corrupt_gradients(layer, epoch=3)
        for p, h in zip(layer.parameters(), honest, strict=True):
            assert torch.allclose(p.grad.norm(), h.norm(), rtol=1e-5)
            assert abs(F.cosine_similarity(p.grad.flatten(), h.flatten(), dim=0)) < 0.5
            p.grad.copy_(h)
    assert not injector.corrupt_gradients(layer, epoch=4)  # 2 steps only


def test_a_claim_epoch_peer_tells_the_swarm_a_far_future_epoch_and_keeps_its_own(dhts):
    """The attack bench's ``claim_epoch``: from its epoch on, the progress records that the peer's tracker
    stores claim its epoch + CLAIM_LEAD (another peer's tracker reads that), while its own reads see its real
    epoch, so that it trains on honestly."""
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.faults import CLAIM_LEAD
    from swarm.waiting import wait_until

    node_a, node_b = dhts(2)
    trackers = [
        ProgressTracker(node, "pytest-claim", target_batch_size=64, private_key=RSAPrivateKey(), start=True)
        for node in (node_a, node_b)
    ]
    claimer, other = trackers
    try:
        injector = FaultInjector(parse_faults("claim_epoch@+2"))
        injector.start(5)
        assert not injector.claim_epochs(claimer, 6)  # due from epoch 7 on
        with claimer.pause_updates():
            claimer.update_epoch(7)
        assert injector.claim_epochs(claimer, 7)
        claimer.report_local_progress(7, 4)
        other.report_local_progress(0, 4)
        assert wait_until(lambda: other.global_epoch == 7 + CLAIM_LEAD, timeout=20), other.global_progress
        assert wait_until(lambda: claimer.global_progress.num_peers == 2, timeout=20), claimer.global_progress
        assert claimer.global_epoch == 7, claimer.global_progress
    finally:
        for tracker in trackers:
            tracker.shutdown()


def test_bf16_autocast_trains_through_hivemind():
    _, strategy, _, module, _ = _fit(SwarmClassifier, steps=4, precision="bf16-mixed")
    assert strategy.local_epoch == 2
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in module.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_amp_with_grad_scaler_on_gpu():
    _, strategy, _, module, _ = _fit(NanOnce, steps=8, precision="16-mixed", device="cuda")
    # the GradScaler skips the overflowing step itself: it is neither applied nor sent
    assert strategy.local_epoch == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["waited", "overlapped"])
def test_a_diloco_peer_trains_on_a_gpu_with_the_fused_inner_adamw(overlap):
    """On CUDA the inner AdamW runs torch's fused kernel, which wants its step counts on the GPU: the inner
    state that DiLoCo creates up front for sharing must be where torch itself would put it."""
    _, strategy, _, module, _ = _fit(
        SwarmClassifier, steps=8, precision="bf16-mixed", device="cuda", averaging="diloco", local_steps=4,
        target_batch_size=128, overlap_rounds=overlap,
    )  # fmt: skip
    inner = strategy.diloco.inner
    assert all(g["fused"] for g in inner.param_groups)
    # (after fit, Lightning's teardown has moved the module back to the CPU; the optimizer's state stays)
    assert all(inner.state[p]["step"].is_cuda for p in module.parameters())
    assert strategy.diloco.outer_steps >= 1 and strategy.local_epoch >= 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


class InfMomentAt(L.Callback):
    """Makes one element of the inner AdamW's second moment Inf after local step ``step``, as an overflow in
    the update would: the parameters stay finite (that element's updates become 0) and so do the gradients."""

    def __init__(self, step: int) -> None:
        self.step, self.seen, self.outer_steps = step, [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        opt = trainer.strategy.diloco.inner
        first = next(iter(module.parameters()))
        if idx == self.step:
            opt.state[first]["exp_avg_sq"].view(-1)[0] = float("inf")
        self.seen.append(bool(torch.isfinite(opt.state[first]["exp_avg_sq"]).all()))
        self.outer_steps.append(trainer.strategy.diloco.outer_steps)  # outer steps run so far


def test_a_diloco_peer_checks_its_inner_state_before_the_outer_step_and_sends_nothing_nonfinite():
    """DiLoCo, alone, 4 inner steps per outer step: an Inf in the inner state after local step 0 (the first)
    is found before the outer step, the state of the last good global epoch comes back, and the anchors, the
    parameters and the inner state end finite. The guard checks once per outer step, not after every inner
    step (at every step it cost 7 % of a DiLoCo peer's main thread): the Inf is still there at the end of
    every local step until the outer step, and gone once it has run.

    That outer step comes after local step 3, or earlier when hivemind's tracker counts the swarm ready by
    its estimate of the time to the target batch (progress_tracker.py:128-134, ``eta_next_epoch``): a lone
    peer whose steps slowed down on a loaded machine reached it after local step 2 (in a fresh clone, when the
    Inf came after local step 1 and so no step was left between it and the check)."""
    spoil = InfMomentAt(step=0)
    _, strategy, _, module, _ = _fit(
        SwarmClassifier, steps=8, averaging="diloco", local_steps=4, callbacks=(spoil,), target_batch_size=128
    )
    assert strategy.guard.rollbacks == 1
    # the first local step at whose end the first outer step had run
    checked = next(i for i, n in enumerate(spoil.outer_steps) if n > 0)
    assert 2 <= checked <= 3, (spoil.outer_steps, spoil.seen)  # at least local step 1 ran with the Inf
    assert spoil.seen[:checked] == [False] * checked, (spoil.seen, checked)  # no check between outer steps
    assert all(spoil.seen[checked:]), spoil.seen
    assert strategy.diloco.outer_steps == 2 and strategy.local_epoch == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert all(torch.isfinite(a).all() for a in strategy.diloco.anchors)
    assert all(torch.isfinite(t).all() for t in strategy.diloco.extra_tensors)


class WatchLandings(L.Callback):
    """Wraps DiLoCo's landing of a round that ran in the background and keeps, for each landing that
    advanced the epoch: the largest distance of the parameters from (new anchor + the steps taken during the
    round), the number of those steps, and how far they moved the parameters."""

    def __init__(self) -> None:
        self.landings: list[tuple[float, int, float]] = []

    def on_train_start(self, trainer, module) -> None:
        d = trainer.strategy.diloco
        land = d._land

        def watched() -> bool:
            before = [p.detach().clone() for p in d.params]  # before the landing moves them
            ends = [t.clone() for t in d._phase_end]
            meanwhile = d.steps
            advanced = land()
            if advanced:
                off = max(
                    float((p.detach() - (a.detach() + (b - e))).abs().max())
                    for p, a, b, e in zip(d.params, d.anchors, before, ends, strict=True)
                )
                moved = max(float((b - e).abs().max()) for b, e in zip(before, ends, strict=True))
                self.landings.append((off, meanwhile, moved))
            return advanced

        d._land = watched


def test_a_diloco_peer_that_overlaps_rounds_keeps_the_steps_it_took_during_each_round():
    """overlap_rounds, alone, 4 inner steps per outer step: each outer round runs in the background while
    the peer takes inner steps, and lands at a later step with the parameters = the new anchor + exactly the
    steps taken meanwhile (at least one, which moved them). The epoch the strategy reports is that of the
    parameters, so it moves when a round lands; every round has its time in the background recorded, and the
    trainer waited for none."""
    watch = WatchLandings()
    _, strategy, _, module, _ = _fit(
        SwarmClassifier,
        steps=16,
        averaging="diloco",
        local_steps=4,
        overlap_rounds=True,
        callbacks=(watch,),
        target_batch_size=128,
    )
    d = strategy.diloco
    assert d.outer_steps >= 2 and strategy.local_epoch == d.outer_steps, (d.outer_steps, strategy.local_epoch)
    assert len(watch.landings) == d.outer_steps, watch.landings
    # a round still in flight when training stops lands at shutdown, with no steps taken meanwhile
    during = watch.landings[:-1] if watch.landings[-1][1] == 0 else watch.landings
    assert len(during) >= 2, watch.landings
    for off, meanwhile, moved in during:
        assert off < 1e-6 and meanwhile >= 1 and moved > 0, watch.landings
    assert watch.landings[-1][0] < 1e-6, watch.landings
    rounds = strategy.clock.rounds
    assert len(rounds) == d.outer_steps and all(r["flight"] > 0 for r in rounds), rounds
    assert d.flight_seconds == pytest.approx(sum(r["flight"] for r in rounds), abs=1e-3 * len(rounds))
    assert all(torch.isfinite(p).all() for p in module.parameters())


class SleepEachStep(L.Callback):
    """Makes every local step last at least ``seconds`` longer (a slow volunteer)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        time.sleep(self.seconds)


def test_a_diloco_peer_paced_by_time_ends_its_inner_phases_by_the_swarms_clock_not_by_local_steps():
    """round_seconds: alone, with a target of 10**6 samples and local_steps 2, a peer whose steps take at
    least 20 ms ends its inner phases when the swarm (itself) has computed for about 1 s (the target paced
    to its speed, swarm/patches/progress.py pace_by_time): not after 2 steps, and not never (10**6 samples
    at about 1000 samples/s are more than 15 minutes away)."""
    _, strategy, *_ = _fit(
        SwarmClassifier,
        steps=200,
        averaging="diloco",
        local_steps=2,
        round_seconds=1.0,
        target_batch_size=10**6,
        callbacks=(SleepEachStep(0.02),),
    )
    d = strategy.diloco
    assert d.outer_steps >= 2 and strategy.local_epoch == d.outer_steps, (d.outer_steps, strategy.local_epoch)
    # a whole phase of about 1 s at <= 50 steps/s, give or take a read of the swarm's progress (0.5 s apart)
    assert 2 < d.full_phase_steps <= 100, d.full_phase_steps
    assert strategy.hivemind_opt.tracker.target_batch_size < 10**5


def test_all_finite_is_exact_for_nan_inf_and_huge_finite_values():
    from swarm.averaging.guard import all_finite

    tensors = [torch.randn(8, 8) for _ in range(5)] + [torch.randn(3, dtype=torch.float64), torch.arange(4)]
    assert all_finite(tensors)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 5):
            broken = [t.clone() for t in tensors]
            broken[i].view(-1)[1] = bad
            assert not all_finite(broken), (bad, i)
    huge = [t.clone() for t in tensors]
    huge[2][0, 0] = 3e38  # finite, although the squared norm overflows float32
    assert all_finite(huge)
    assert all_finite([])


def test_a_state_whose_parameters_went_uphill_is_rejected_by_the_loss_of_the_latest_batch():
    """Colluders that own a state round's group make its result their parameters, and a few uphill steps
    leave those as near as an honest groupmate's (within STATE_RADIUS). The screen asks the strategy for the
    loss of this peer's latest batch with them (``_probe_loss``) and keeps its own parameters; an honest
    groupmate's, a few steps downhill on other data with the Adam it trained with, pass. The probe leaves the
    module's parameters as they were. A download from a donor that went uphill is refused the same way."""
    from swarm.averaging.screen import PROBE_RISE, PROBE_SHARE, STATE_RADIUS, _distance, total_norm
    from swarm.training.data import build_datasets

    cfg, strategy, _, module, _ = _fit(SwarmClassifier, steps=6)
    mine = list(module.parameters())
    train, _ = build_datasets(cfg.data, cfg.model.img_size)
    others = [next(iter(train_loader(train, cfg.data, seed=seed))) for seed in (1, 2, 3)]

    def stepped(sign: float, steps: int, lr: float, batches: list, then: tuple | None = None) -> tuple:
        """The parameters after ``steps`` of Adam on ``batches`` (uphill for ``sign`` -1) from the module's
        with a fresh Adam, or going on from ``then`` (a model and its Adam); and that model and Adam."""
        if then is None:
            copy = SwarmClassifier(cfg.model, cfg.train, weights=False)
            copy.load_state_dict(module.state_dict())
            then = copy, torch.optim.Adam(copy.parameters(), lr=lr)
        copy, opt = then
        for i in range(steps):
            opt.zero_grad()
            (sign * copy.batch_loss(batches[i % len(batches)])).backward()
            opt.step()
        return [p.detach().clone() for p in copy.parameters()], then

    latest, _ = strategy._latest_batch
    trained, peer = stepped(1.0, 30, 2e-3, [latest, *others])  # a peer some way into training
    with torch.no_grad():
        for p, value in zip(mine, trained, strict=True):
            p.copy_(value)
    before = [p.detach().clone() for p in mine]
    norm = total_norm(before)
    # colluders' few uphill steps, with a fresh Adam (its first steps move every coordinate by the learning
    # rate); an honest groupmate that went on alone for a few steps on other data, with the Adam it had
    uphill, _ = stepped(-1.0, 3, 2e-3, others)
    honest, _ = stepped(1.0, 3, 2e-3, others, then=peer)
    # the distance alone lets it through (0.075 of the norm here; the honest one 0.023, where honest state
    # rounds lay up to 0.04 apart)
    assert _distance(before, uphill) / norm < STATE_RADIUS
    own, averaged = strategy._probe_loss(mine, uphill)
    assert averaged > own + PROBE_RISE + PROBE_SHARE * own, (own, averaged)
    roles = ["parameters"] * len(mine)
    reason = strategy.screen.judge_state(mine, uphill, roles)
    assert reason is not None and "raise the loss of this peer's latest batch" in reason, reason
    assert strategy.screen.rejected_state_rounds == 1
    assert strategy.screen.judge_state(mine, honest, roles) is None
    assert strategy.screen.rejected_state_rounds == 1 and len(strategy.screen.probed) == 2
    assert all(torch.equal(p, q) for p, q in zip(mine, before, strict=True))
    # a download: the module's parameters already hold the donor's, judged against a copy of the peer's own
    for new, kind_of in ((uphill, "a donor that went uphill"), (honest, "an honest donor")):
        with torch.no_grad():
            for p, value in zip(mine, new, strict=True):
                p.copy_(value)
        reason = strategy.screen.judge_state(before, mine, roles, kind="download")
        assert (reason is None) == (new is honest), (kind_of, reason)
    assert strategy.screen.rejected_downloads == 1


def test_a_gradient_round_that_turns_uphill_is_rejected_by_the_step_adam_would_take():
    """Two colluders of five whose x -8 flips the robust rule only partly clips turn a round's average
    uphill while it stays within RADIUS of an honest peer's gradient. The screen asks the loss of the latest
    batch and of one held out of this epoch's gradients (the latest batch of the epoch before) after the step
    Adam would take on the average without its momentum, and after the same step on this peer's own
    gradient (``judge_step``): the colluders' round raises both far more than its own step, an honest
    average of other batches does not, and the optimizer and parameters are left as they were."""
    cfg, strategy, _, module, _ = _fit(SwarmClassifier, steps=6)  # 3 epochs of 2 steps
    train, _ = build_datasets(cfg.data, cfg.model.img_size)
    loader = iter(train_loader(train, cfg.data, seed=1))
    others = [next(loader) for _ in range(16)]
    latest, _ = strategy._latest_batch
    held_out, _ = strategy._held_out_batch  # kept by the training steps themselves
    assert not torch.equal(held_out[0], latest[0])
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=2e-3)
    for batch in [latest, *others] * 2:  # a peer some way into training
        opt.zero_grad()
        module.batch_loss(batch).backward()
        opt.step()

    def gradient(batches: list) -> list[torch.Tensor]:
        module.zero_grad()
        for batch in batches:
            (module.batch_loss(batch) / len(batches)).backward()
        return [p.grad.detach().clone() for p in params]

    own, honest, flipped = gradient([latest]), gradient(others[:8]), gradient(others[8:])
    # three honest parts and two at x -8, as a plain mean would give them
    colluded = [(3 * h - 16 * f) / 5 for h, f in zip(honest, flipped, strict=True)]
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    screen = strategy.screen
    # off by default (the swarm setting judge_steps): no round is judged so
    assert screen.judge_step(params, colluded, own, opt) is None and not screen.stepped
    screen.judge_steps = True
    assert screen.judge_step(params, honest, own, opt) is None, screen.stepped
    reason = screen.judge_step(params, colluded, own, opt)
    assert reason is not None and "a step on the averaged gradient raises" in reason, screen.stepped
    assert screen.rejected_gradient_rounds == 1 and len(screen.stepped) == 2
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], m) for p, m in zip(params, moments, strict=True))
    # an optimizer without Adam's moments is not judged so
    assert screen.judge_step(params, colluded, own, torch.optim.SGD(params, lr=0.1)) is None
    # a lone rejection by the step is news (one honest round in about 200 is rejected so); the next round
    # that passes its norm and distance but not its step makes two in a row, a warning
    assert screen.by_step and screen.in_row["gradient"] == 1
    assert screen.judge_gradients(own, own) is None and screen.in_row["gradient"] == 0
    assert screen.judge_step(params, colluded, own, opt) is not None and screen.in_row["gradient"] == 2
