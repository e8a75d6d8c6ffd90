"""Where the end of each global epoch goes: one record per round, split into its parts.

A round ends in the local step at which the swarm has ``target_batch_size`` samples. That step's wall time
(``end``) is split into:

* ``matchmaking``: from the moment this peer is ready until its gradient group is assembled (zero when the
  group was found while this peer still computed, which is what pre-scheduling is for);
* ``allreduce``: the gradient all-reduce itself, waiting for the slowest member's trigger included;
* ``state``: the parameter (and optimizer statistics) averaging round, at epochs where it runs;
* ``update``: the optimizer's own update (AdamW, or DiLoCo's outer SGD);
* ``other``: the rest (hivemind's bookkeeping, the progress tracker, finiteness checks).

``outcome`` says what the update used: ``averaged`` (the group's average, ``group`` peers), ``partial`` (the
group's average for the share ``received`` of the numbers, this peer's own for the rest: a groupmate's
reducer failed or went silent for ``next_chunk_timeout`` in the middle of the round), ``local`` (the round
failed; this peer's own gradient of the round, see swarm/patches/grad_averager.py) or ``alone`` (no other
peer); ``downloaded`` when no round ran and the epoch came with a state downloaded from peers
(a newcomer, or a peer that fell behind: hivemind's ``step`` downloads instead of averaging; ``group`` 0).
``strangers`` counts the groupmates that never learnt of this peer's gradient group
(docs/hivemind-patches.md item 11: the state round of that epoch is skipped). ``rejected`` lists the averaged
results this peer's screen refused in the round (``gradient``, ``state``; see swarm/averaging/screen.py): a
rejected gradient round also steps on this peer's own gradient. ``agreed`` is true when the epoch's state
round was skipped because the whole group already held one state (docs/hivemind-patches.md item 16).

A DiLoCo round that ran in the background (``--overlap-rounds``) has ``flight``, its wall time while the
trainer went on with inner steps; its parts are parts of that, and ``end`` is only what the trainer waited
(the landing of the new anchor).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PARTS = ("matchmaking", "allreduce", "state", "update")
POLL_MAX = 0.02  # seconds between two looks at a round's stage, at most


class RoundClock:
    """Times the parts of each round by wrapping three methods of one ``hivemind.Optimizer`` instance."""

    def __init__(self, opt: Any, update_optimizer: torch.optim.Optimizer) -> None:
        from hivemind.averaging.control import AveragingStage

        self._looking = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        self.opt = opt
        self.rounds: list[dict[str, Any]] = []
        self._reset()
        self._in_round = False
        opt._average_gradients_and_load_into_optimizer = self._timed_gradients(
            opt._average_gradients_and_load_into_optimizer
        )
        opt._update_global_epoch = self._marked_round(opt._update_global_epoch)
        opt.state_averager.step = self._timed_state(opt.state_averager.step)
        self._update_started = 0.0
        self._hooks = [
            update_optimizer.register_step_pre_hook(self._before_update),
            update_optimizer.register_step_post_hook(self._after_update),
        ]

    def _reset(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.outcome, self.group, self.strangers, self.received = "alone", 1, 0, 1.0
        self.ran = False  # whether hivemind's epoch update ran since the last record (else: a download)
        self.rejected: list[str] = []
        self.agreed = False

    # ---- wrappers ---------------------------------------------------------------------------------------
    def _marked_round(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._in_round = self.ran = True
            try:
                return method(*args, **kwargs)
            finally:
                self._in_round = False

        return wrapped

    def _timed_gradients(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(control: Any) -> Any:
            began = time.perf_counter()
            if control is not None:  # the trigger is set: wait until the group is there (or the round failed)
                # only the split between the parts waits for this (the averager goes on by itself): polls
                # from 1 ms, spaced out to POLL_MAX, so that a wait of seconds for a group (a round in the
                # background, while the trainer computes) does not wake the process a thousand times a second
                pause = 0.001
                while not control.done() and control.stage in self._looking:
                    time.sleep(pause)
                    pause = min(pause * 1.5, POLL_MAX)
            found = time.perf_counter()
            fallbacks = getattr(self.opt.grad_averager, "local_fallbacks", 0)
            try:
                return method(control)
            finally:
                self.parts["matchmaking"] += found - began
                self.parts["allreduce"] += time.perf_counter() - found
                if getattr(self.opt.grad_averager, "local_fallbacks", 0) > fallbacks:
                    self.outcome = "local"
                elif control is not None and control.done() and control.exception() is None:
                    result = control.result()
                    self.received = getattr(result, "received", 1.0)
                    self.outcome = "averaged" if self.received >= 1 else "partial"
                    self.group, self.strangers = len(result), len(getattr(result, "strangers", ()))

        return wrapped

    def _timed_state(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not (self._in_round and kwargs.get("increment_epoch")):
                return method(*args, **kwargs)
            began, update_before = time.perf_counter(), self.parts["update"]
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - began - (self.parts["update"] - update_before)
                if kwargs.get("averaging_round"):
                    self.parts["state"] += spent

        return wrapped

    def _before_update(self, *args: Any) -> None:
        self._update_started = time.perf_counter()

    def _after_update(self, *args: Any) -> None:
        if self._update_started:
            self.parts["update"] += time.perf_counter() - self._update_started
            self._update_started = 0.0

    # ---- records ----------------------------------------------------------------------------------------
    def close_round(
        self, epoch: int, end_seconds: float, flight: float = 0.0, state_away: float | None = None
    ) -> dict[str, Any]:
        """Record the round that ended at global epoch ``epoch`` after ``end_seconds`` of its last step (and
        ``flight`` seconds in the background, if it ran there); ``state_away``: how far its accepted state
        round moved the parameters (swarm/averaging/screen.py ``take_state_away``)."""
        parts = {k: round(v, 4) for k, v in self.parts.items()}
        if not self.ran:
            self.outcome, self.group = "downloaded", 0
        record = {
            "epoch": epoch,
            "end": round(end_seconds, 4),
            "flight": round(flight, 4),
            **parts,
            "other": round(max(0.0, max(end_seconds, flight) - sum(self.parts.values())), 4),
            "outcome": self.outcome,
            "received": round(self.received, 4),
            "group": self.group,
            "strangers": self.strangers,
            "rejected": self.rejected,
            "agreed": self.agreed,
            "state_away": None if state_away is None else round(state_away, 4),
        }
        self.rounds.append(record)
        self._reset()
        return record

    def summary(self) -> dict[str, Any]:
        """Totals, medians and outcome counts over the recorded rounds (for summary.json)."""
        rounds = self.rounds
        out: dict[str, Any] = {"rounds": len(rounds)}
        for key in ("end", "flight", *PARTS, "other"):
            values = [r.get(key, 0.0) for r in rounds]
            out[f"{key}_seconds_total"] = round(sum(values), 3)
            out[f"{key}_seconds_median"] = round(statistics.median(values), 4) if values else None
        for outcome in ("averaged", "partial", "local", "alone", "downloaded"):
            out[outcome] = sum(r["outcome"] == outcome for r in rounds)
        out["rejected"] = sum(bool(r.get("rejected")) for r in rounds)
        out["met_strangers"] = sum(r.get("strangers", 0) > 0 for r in rounds)
        out["state_skipped_in_agreement"] = sum(bool(r.get("agreed")) for r in rounds)
        return out

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
