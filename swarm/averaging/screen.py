"""RoundScreen: every peer checks each averaged result before it applies it.

An all-reduce hands each peer the weighted mean of what the group sent. One peer that sends outsized numbers
(an attacker, or an honest peer with a bug: a wrong normalisation, an fp16 overflow) moves that mean as far
as it likes, and the guard (swarm/averaging/guard.py) only catches non-finite values. The screen judges two
results:

- **a gradient round** (docs/hivemind-patches.md item 7): the averaged gradient's norm against ``factor``
  times the larger of this peer's own gradient norm of the same round and the median norm of the last accepted
  rounds. A mean of honest gradients is never longer than the longest of them (the triangle inequality), so an
  honest round stays near this peer's own norm; a peer whose gradient is 10,000 times too large moves the mean
  of 3 peers about 3,000 times.
- **a state averaging round** (parameters, optimizer statistics, extra tensors), role by role: the
  averaged tensors' norm against the larger of this peer's own and the median norm of that role in the last
  accepted states (averaged or downloaded), times ``factor`` for parameters and ``factor`` squared for the
  rest. Honest peers' parameters have norms of the same order. Their optimizer statistics need not: AdamW's
  ``exp_avg_sq`` grows with the square of the gradient, and honest DiLoCo peers' inner moments differed by
  more than 10x (a 3-peer round of DiLoCo averaged them to 10.8 against one peer's 0.98 and another's 0.455:
  both rejected it at 10x and went on apart). An attacker's ``exp_avg_sq`` after 10,000x gradients is 10^8
  times larger. The median matters for moments that this peer has only begun to build.

- **a state averaging round's distance**, where the peers hold one state (gradient averaging): the averaged
  parameters must also lie within ``STATE_RADIUS`` (0.25) times the norm of this peer's own parameters from
  them. Peers at one global epoch hold nearly one state (in the attack bench's runs, honest state rounds lay
  at most 0.04 of the norm away, and up to 0.31 only after an attack had mixed the peers' states); random
  parameters of an honest norm lie 1.41 away, two colluders in a group of three make the robust result
  theirs, and two in a group of four left it 0.46-0.49 away (at a limit of 1 such rounds took honest peers
  to val acc 0.52 within 3 epochs; at 0.5 two such rounds in a row, each accepted, took them from 0.939 to
  0.563). DiLoCo's peers each take their own inner steps between outer rounds, and honest state rounds among
  them lay up to 0.52 away: not judged so. Nor is a download: a newcomer's parameters are not the swarm's
  (swarm/averaging/donors.py checks downloads).

- **a state's loss**, where the peers hold one state and the strategy gave the screen a ``probe``: the
  averaged (or downloaded) parameters must not raise the loss of this peer's latest training batch by more
  than ``PROBE_RISE`` (0.3) plus ``PROBE_SHARE`` (0.5) of the loss with its own parameters. Colluders that
  are half of a state round's group or more make its robust result their parameters, and a few uphill
  steps leave those as near as an honest groupmate's: 0.023 of the norm took a peer from val acc 0.83 to
  0.33, where honest state rounds lay up to 0.04 away. Two colluders an epoch ahead of the rest were the
  only donors of that epoch and vouched for each other's state (swarm/averaging/donors.py), and a
  download from them took an honest peer from 0.763 to 0.245. In the attack bench the probe's rejected
  rounds raised the loss from 0.16-0.58 to 0.68-4.37; in runs without an attacker no probed round raised
  it by more than 0.22.

- **a state download** (hivemind.Optimizer downloads the newest peer's state whenever this peer falls
  behind): judged like a state averaging round, against the state this peer held before.

- **a gradient round's step** (where ``judge_steps`` is on, the swarm setting of that name, off by default;
  gradient averaging, with a probe and an optimizer that keeps Adam's second moments): the step that Adam
  would take on the averaged gradient without its momentum (each gradient over the root of its second moment
  updated with it) may raise the loss of this peer's latest batch, or that of a batch held out of this epoch's
  gradients (the latest of the epoch before), at most ``STEP_RISE`` (1) more than the same step on this peer's
  own gradient; the round is rejected only where both batches see it go further uphill (``judge_step``). Two
  colluders of four or five whose x -8 flips the robust rule only partly clips turn an average uphill while it
  lies within ``RADIUS``; Adam then carries it on for several steps (an honest peer went from val acc 0.905 to
  0.359 in 3 epochs through two such rounds). Without momentum a step judges the round itself, but it is
  large, and honest rounds go over the limit too: with the latest batch alone 6 of 696 in a run without an
  attacker, with the held-out batch alone 4 of 641, with both 3 of 596 (the colluders' rounds rose 1-3 more),
  and 9 of about 960 in four runs of the multi-peer localhost test. A peer that rejects a round keeps its own
  state and skips the epoch's state round, so it holds another state than the others for an epoch or two:
  hence off by default. A step of the learning rate against the gradient's sign was worse (26 honest rounds
  rejected).

- **a gradient round's distance**: the averaged gradient must also lie within ``RADIUS`` (3) times the
  reference (above) of this peer's own gradient. In a round of two no robust rule can outvote the other peer
  (swarm/patches/robust.py gives the plain weighted mean of two); in a larger group the robust rule outvotes a
  minority, but a group whose attackers are half or more of it is theirs (two colluders in a group of three,
  or two of four once an honest peer has banned them and left), and the robust result is then their numbers.
  An honest group's average lies between honest gradients, so no further from this peer's own than the
  furthest of them, and in a larger group nearer: averaging cancels the others' noise (the mean of three
  gradients whose noise is four times their common part lies 0.8 times this peer's norm away; in the demo,
  groups of three lay up to 2.1 times the reference away). The mean of two honest gradients lies between them,
  (W - w) / W of their distance from this peer's own gradient for weights w (this peer's) and W - w; in the
  demo an honest round of a 32-sample peer with a 224-sample one lay 2.3 times the reference away, early in
  training (a limit of 1.5 rejected it). A gradient times -8 in a round of equal weights moves the mean 4-4.5
  times the reference away, and 8-9 times if it announces most of the samples; at x-4 (2.1-2.5 times) or less
  it passes, and the groups of three that it joins clip and ban it (suspects.py); a round of two scores the
  other peer by its distance there too (``PAIR_SUSPECT``, 2 times: a clipped round); a larger round scores
  nobody by it (the screen cannot tell which groupmates moved the average). A check of direction (reject an
  average pointing against this peer's own gradient) rejected honest rounds too: a 32-sample peer's noisy
  gradient had cosine -0.52 with the average of its round with a 224-sample one.

A rejected round is not applied: for gradients the peer steps on its own gradient of the round (as after
a failed round) and skips that epoch's state round (colluders that own a group's gradient round own its state
round too: swarm/patches/optimizer.py ``skip_state_rounds_after_rejection``), for the state (averaged or
downloaded) it keeps its own state. A state round rejected for
its distance (``take_far_state``) has the peer ask the swarm's published sketches whether its own state is
the one astray (swarm/averaging/donors.py ``DonorCheck.astray``); if so it downloads the swarm's
(swarm/averaging/strategy.py ``_check_own_state``) rather than reject every later round. Each rejection is
counted and logged with its figure. This detects outsized updates; it does not outvote a peer that sends
plausible but wrong numbers (that needs robust aggregation, e.g. CenteredClip).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence

import torch

from swarm.averaging.guard import all_finite
from swarm.suspects import SUSPECT_SCALE


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together, in float64 (inf or nan if any value is)."""
    floats = [t.detach() for t in tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return 0.0
    # accumulated in float64 without a float64 copy of the tensors (ViT-B/32's gradient: 88 M numbers)
    norms = torch._foreach_norm(floats, 2, dtype=torch.float64)
    return float(torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms])))


PAIR_SUSPECT = 2.0  # a round of two this many times the reference away scores the other SUSPECT_SCALE
RADIUS = 3.0  # every gradient round: the average within this many times the reference of this peer's gradient
# a state round's averaged parameters within this many times the own ones' norm of them, where the peers hold
# one state (gradient averaging; DiLoCo's peers each take their own inner steps between rounds)
STATE_RADIUS = 0.25
# a state round's averaged parameters may raise this peer's loss on its latest training batch by at most
# PROBE_RISE (nats) plus PROBE_SHARE of the loss with its own parameters, where the peers hold one state and
# the screen has a probe
PROBE_RISE = 0.3
PROBE_SHARE = 0.5
# a gradient round, where the screen has a probe: the step that Adam would take on the averaged gradient
# without its momentum may raise the loss of this peer's latest batch, or of its held-out one, at most this
# much (nats) more than the same step on this peer's own gradient
STEP_RISE = 1.0

# (this peer's parameters, *candidates[, held_out]) -> the loss of this peer's latest batch (held_out: the
# latest batch of an earlier epoch) with its own parameters, then with each candidate; or None
Probe = Callable[..., "tuple[float, ...] | None"]


def _distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The L2 norm of ``a - b``, one tensor's difference at a time."""
    pairs = zip(a, b, strict=True)
    return math.sqrt(
        sum(
            float(torch.linalg.vector_norm(x.detach() - y.detach(), dtype=torch.float64)) ** 2
            for x, y in pairs
        )
    )


def _inner(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The inner product of ``a`` and ``b`` taken as one vector each, accumulated in float64."""
    pairs = zip(a, b, strict=True)
    return sum(
        float((x.detach().double() * y.detach().double()).sum()) for x, y in pairs if x.is_floating_point()
    )


class RoundScreen:
    """Judges averaged results. ``factor`` <= 0 turns every check off except the one for non-finite values."""

    radius = RADIUS  # a gradient round's average within this many times the reference of this peer's own

    def __init__(self, factor: float = 10.0, history: int = 16) -> None:
        self.factor = factor
        self.norms: deque[float] = deque(maxlen=history)  # norms of the last accepted gradient rounds
        # norms of each part (parameters, optimizer statistics, extra tensors) of the last accepted states
        self.part_norms: dict[str, deque[float]] = {}
        self.history = history
        self.last_distance = 0.0  # of the last gradient round: its distance over the reference
        self.last_pair_distance = 0.0  # the same, of the last round if it was a round of two, else 0
        self.rejected_gradient_rounds = 0
        self.rejected_state_rounds = 0
        self.rejected_downloads = 0
        # results of each kind rejected since the last accepted one
        self.in_row = {"gradient": 0, "state": 0, "download": 0}
        self._gradient_row = 0  # the gradient rounds rejected in a row before the latest that passed
        # whether the latest rejection was a gradient round's step alone (judge_step): about 1 honest round
        # in 100 to 200 is, so a lone one is news rather than a warning (HivemindStrategy._on_rejected_round)
        self.by_step = False
        # a state round's average lay beyond STATE_RADIUS since the peer last asked (``take_far_state``):
        # either groupmates that own the group sent other parameters, or this peer's own state is astray
        self._far_state = False
        # the largest distance of an accepted state round's parameters from this peer's own (over their norm)
        # since the last ``take_state_away``: what each round of the peer's record moved it by
        self._state_away: float | None = None
        # judge gradient rounds by a step on them too (``judge_step``; the swarm setting ``judge_steps``)
        self.judge_steps = False
        # set by HivemindStrategy once the peer has trained on a batch (``Probe``); None: no loss is asked
        self.probe: Probe | None = None
        # of the state rounds the probe judged: the loss with this peer's parameters, and with the averaged
        self.probed: list[tuple[float, float]] = []
        # of the gradient rounds it judged: the rise of the loss after a step on this peer's own gradient, and
        # after one on the averaged gradient
        self.stepped: list[tuple[float, float]] = []

    @property
    def pair_scale(self) -> float:
        """The other peer's scale in the last round of two (swarm/suspects.py): ``SUSPECT_SCALE`` at
        ``PAIR_SUSPECT`` times the reference from this peer's own gradient, less further away, at most 1."""
        return self.scale_at(self.last_pair_distance)

    @staticmethod
    def scale_at(distance: float) -> float:
        """A groupmate's scale for an average ``distance`` times the reference from this peer's own gradient:
        ``SUSPECT_SCALE`` at ``PAIR_SUSPECT``, less further away, at most 1 (0 where not finite)."""
        if not math.isfinite(distance):
            return 0.0
        return min(1.0, SUSPECT_SCALE * PAIR_SUSPECT / distance) if distance > 0 else 1.0

    @property
    def rejected(self) -> int:
        return self.rejected_gradient_rounds + self.rejected_state_rounds + self.rejected_downloads

    def take_far_state(self) -> bool:
        """Whether a state round was rejected for its distance since the last call (then cleared): the
        peer then asks the swarm whether its own state is the one astray (swarm/averaging/donors.py
        ``DonorCheck.astray``)."""
        far, self._far_state = self._far_state, False
        return far

    def take_state_away(self) -> float | None:
        """The largest distance, over this peer's own parameters' norm, of averaged parameters that a state
        round gave and this screen accepted since the last call (then cleared); None if none was judged so."""
        away, self._state_away = self._state_away, None
        return away

    def _outsized(self, norm: float, reference: float, limit: float | None = None) -> bool:
        """Whether ``norm`` is more than ``limit`` (by default ``factor``) times ``reference``."""
        limit = self.factor if limit is None else limit
        return self.factor > 0 and reference > 0 and norm > limit * reference

    def judge_gradients(
        self,
        averaged: Sequence[torch.Tensor],
        own: Sequence[torch.Tensor],
        own_scale: float = 1.0,
        group_size: int | None = None,
    ) -> str | None:
        """None if the averaged gradient may be applied, else why not (with the figures). ``own_scale``
        multiplies this peer's own norm where its share of the round was shorter than an honest peer's can
        be (a DiLoCo peer that took fewer inner steps than the others: swarm/averaging/diloco.py). A round is
        also judged by its distance from this peer's own gradient; ``group_size`` (2: a round of two, whose
        distance scores the other peer, :attr:`pair_scale`) names it in the reason."""
        norm, mine = total_norm(averaged), total_norm(own)
        reference = max([mine * own_scale] + ([statistics.median(self.norms)] if self.norms else []))
        judged = self.factor > 0 and reference > 0 and mine > 0
        self.last_distance = _distance(averaged, own) / reference if judged else 0.0
        self.last_pair_distance = self.last_distance if group_size == 2 else 0.0
        if not math.isfinite(norm):
            reason = f"the averaged gradient is non-finite (norm {norm})"
        elif self._outsized(norm, reference):
            reason = (
                f"the averaged gradient's norm {norm:.3g} is {norm / reference:.0f}x this peer's reference "
                f"{reference:.3g} (own gradient {mine:.3g}"
                + (f" x {own_scale:.3g}" if own_scale != 1.0 else "")
                + f"; the limit is {self.factor:g}x)"
            )
        elif judged and self.last_distance > self.radius:
            pair = group_size == 2
            group = "in a round of two" if pair else f"in a round of {group_size or 'unknown size'}"
            others = "the other peer's gradient is" if pair else "the group's gradients are"
            reason = (
                f"{group}, the averaged gradient lies {self.last_distance:.2g}x this peer's reference "
                f"{reference:.3g} from its own gradient (the limit is {self.radius:g}x): {others} far from "
                "this peer's"
            )
        else:
            self.norms.append(norm)
            self._gradient_row = self.in_row["gradient"]  # a rejection by its step (judge_step) goes on
            self.in_row["gradient"] = 0
            return None
        self.rejected_gradient_rounds += 1
        return self._rejected("gradient", reason)

    def judge_state(
        self,
        local: Sequence[torch.Tensor],
        averaged: Sequence[torch.Tensor],
        roles: Sequence[str],
        kind: str = "state",
        wholes: dict[str, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] | None = None,
    ) -> str | None:
        """None if the averaged (``kind`` "state") or downloaded ("download") state may replace ``local``,
        else why not. ``roles`` names each tensor's part (parameters, optimizer statistics, extra tensors);
        each part is judged on its own. ``wholes`` adds parts given as (this peer's tensors, the new ones),
        lists that need not match one to one (a newcomer's empty optimizer state against a donor's). A part
        that is all zeros here (a newcomer's optimizer statistics) cannot be judged by size, and passes
        unless it is non-finite."""
        parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for mine, theirs, role in zip(local, averaged, roles, strict=True):
            pair = parts.setdefault(role, ([], []))
            pair[0].append(mine)
            pair[1].append(theirs)
        for role, (mine, theirs) in (wholes or {}).items():
            parts[role] = (list(mine), list(theirs))
        what = "averaged" if kind == "state" else "downloaded"
        # DiLoCo's state carries each peer's own inner moments (extra tensors): its peers hold one state only
        # at its outer steps, and honest state rounds among them lay up to 0.52 of the norm away
        one_state = "extra tensors" not in roles
        sizes = {}
        for role, (mine, theirs) in parts.items():
            reason, sizes[role] = self._judge_part(role, mine, theirs, what, one_state)
            if reason is None:
                continue
            if kind == "state":
                self.rejected_state_rounds += 1
            else:
                self.rejected_downloads += 1
            return self._rejected(kind, reason)
        for role, size in sizes.items():
            if size > 0:  # an all-zero part (optimizer statistics not yet built) says nothing about sizes
                self.part_norms.setdefault(role, deque(maxlen=self.history)).append(size)
        self.in_row[kind] = 0
        return None

    def _judge_part(
        self, role: str, mine: list[torch.Tensor], theirs: list[torch.Tensor], what: str, one_state: bool
    ) -> tuple[str | None, float]:
        """(why the new ``theirs`` may not replace ``mine``, or None; the new part's norm)."""
        # sizes leave out one-number tensors: step counters (DiLoCo's inner AdamW steps travel as extra
        # tensors) of a peer that fell far behind differ from the swarm's by design
        size = total_norm([t for t in theirs if t.numel() > 1])
        own = total_norm([t for t in mine if t.numel() > 1])
        if not all_finite(theirs):
            return f"the {what} {role} are non-finite", size
        recent = self.part_norms.get(role)
        reference = max([own] + ([statistics.median(recent)] if recent else []))
        limit = self.factor if role == "parameters" else self.factor**2  # statistics of squared gradients
        if own > 0 and self._outsized(size, reference, limit):
            return (
                f"the {what} {role} have norm {size:.3g}, {size / reference:.0f}x this peer's reference "
                f"{reference:.3g} (its own {own:.3g}; the limit is {limit:g}x)"
            ), size
        if role == "parameters" and one_state and own > 0 and self.factor > 0:
            away = _distance(mine, theirs) / own if what == "averaged" else 0.0
            if away > STATE_RADIUS:
                self._far_state = True
                return (
                    f"the averaged parameters lie {away:.2f} times their own norm from this peer's (the "
                    f"limit is {STATE_RADIUS:g}: peers at one global epoch hold nearly one state; most "
                    f"likely groupmates that are half of the group or more sent other parameters)"
                ), size
            reason = self._probe_state(mine, theirs, what)
            if reason is not None:
                return reason, size
            if what == "averaged":
                self._state_away = max(away, self._state_away or 0.0)
        return None, size

    def _probe_state(self, mine: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> str | None:
        """Why the ``what`` ("averaged" or "downloaded") parameters ``theirs`` may not replace ``mine`` by the
        loss they give this peer's latest training batch, or None. Colluders that are half of a state
        round's group or more make its robust result their parameters; those that took a few uphill steps
        lie as near as honest peers do (0.023 of the norm, against honest rounds up to 0.04) yet took a peer
        from val acc 0.83 to 0.33. Two such colluders that run an epoch ahead are the only donors of it, and
        vouch for each other's state (swarm/averaging/donors.py). The probe needs the module's own tensors
        first: after a download they hold the downloaded parameters, and ``mine`` is a copy."""
        if self.probe is None:
            return None
        losses = self.probe(theirs, mine) if what == "downloaded" else self.probe(mine, theirs)
        if losses is None:
            return None
        own, new = losses if what == "averaged" else losses[::-1]
        self.probed.append((own, new))
        limit = PROBE_RISE + PROBE_SHARE * own
        if new <= own + limit:  # False for nan
            return None
        return (
            f"the {what} parameters raise the loss of this peer's latest batch from {own:.3f} to {new:.3f} "
            f"(the limit is a rise of {limit:.3f}: {PROBE_RISE:g} plus {PROBE_SHARE:g} of its own; most "
            f"likely peers that went uphill: groupmates that are half of the group or more, or a donor)"
        )

    def judge_step(
        self,
        params: Sequence[torch.Tensor],
        averaged: Sequence[torch.Tensor],
        own: Sequence[torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
    ) -> str | None:
        """None if a gradient round that passed :meth:`judge_gradients` may be applied, else why not: judged
        by the loss of two batches (this peer's latest, and one held out of this epoch's gradients) after the
        step that Adam (``optimizer``'s moments and rates) would take on the averaged gradient alone, without
        its momentum, against the same step on this peer's own gradient; rejected where both see it go
        more than ``STEP_RISE`` further uphill. Two colluders of four or five whose flips the robust rule
        only partly clips turn a round's average uphill while it lies within ``RADIUS`` of this peer's
        gradient; Adam's momentum then carries the damage on for several steps, so the step is judged
        without it. None also where the optimizer keeps no Adam moments for every parameter, or before this
        peer has a held-out batch, or where ``judge_steps`` is off (the default: it also rejects 1 honest
        round in 100 to 200)."""
        if not self.judge_steps or self.probe is None or self.factor <= 0 or own is None:
            return None
        own_step = _adam_steps(optimizer, params, own)
        averaged_step = _adam_steps(optimizer, params, averaged)
        if own_step is None or averaged_step is None:
            return None
        # two witnesses: the latest batch (in this peer's own gradient, which favours its own step) and one
        # held out of every gradient of this epoch; the round is rejected only where both see it go uphill
        seen = []
        for held_out in (False, True):
            losses = self.probe(params, own_step, averaged_step, held_out=held_out)
            if losses is None:
                return None
            before, own_after, averaged_after = losses
            seen.append((own_after - before, averaged_after - before))
        excess = [averaged - own if math.isfinite(averaged - own) else math.inf for own, averaged in seen]
        own_rise, averaged_rise = seen[excess.index(min(excess))]  # the witness that sees the least rise
        self.stepped.append((own_rise, averaged_rise))
        if averaged_rise <= own_rise + STEP_RISE:  # False for nan
            return None
        self.rejected_gradient_rounds += 1
        self.in_row["gradient"] = self._gradient_row  # judge_gradients, which passed it, had ended the row
        (latest_own, latest_averaged), (held_own, held_averaged) = seen
        return self._rejected(
            "gradient",
            f"a step on the averaged gradient raises the loss of this peer's latest batch by "
            f"{latest_averaged:.3f} and of a batch held out of it by {held_averaged:.3f}, one on its own "
            f"gradient by {latest_own:.3f} and {held_own:.3f} (the limit is {STEP_RISE:g} more than its own "
            f"on both): groupmates that sent uphill gradients, or a rare honest round (1 in 100 to 200 "
            f"goes so far)",
            by_step=True,
        )

    def _rejected(self, kind: str, reason: str, by_step: bool = False) -> str:
        self.in_row[kind] += 1
        self.by_step = by_step
        return reason


def _adam_steps(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """The parameters after the step that Adam would take on ``grads`` without momentum (each gradient over
    the root of its second moment updated with it, bias-corrected, times the learning rate), the optimizer
    left as it was; None if some parameter has no Adam moments yet."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    stepped = []
    with torch.no_grad():
        for p, grad in zip(params, grads, strict=True):
            state, group = optimizer.state.get(p), group_of.get(id(p))
            if not state or group is None or "exp_avg_sq" not in state or "betas" not in group:
                return None
            g = grad.to(p.device, torch.float32)
            beta2, t = group["betas"][1], float(state["step"]) + 1
            second = (beta2 * state["exp_avg_sq"].float() + (1 - beta2) * g * g) / (1 - beta2**t)
            stepped.append((p.float() - group["lr"] * g / (second.sqrt() + group["eps"])).to(p.dtype))
    return stepped
