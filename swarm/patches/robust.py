"""Robust aggregation (hivemind/averaging/partition.py ``TensorPartReducer``): the peer that reduces a part
of an all-reduce no longer takes the plain weighted mean of what its groupmates sent.

**What hivemind does.** In a round, each peer reduces one slice of the averaged vector (butterfly
all-reduce): ``TensorPartReducer.accumulate_part`` (partition.py:218-246) adds every sender's part,
multiplied by the weight the sender itself announced, and divides by the summed weights
(``check_current_part_finished``, partition.py:257-261). Gradient rounds and state rounds (parameters,
optimizer statistics) go through it alike.

**What goes wrong** (item 21 of docs/hivemind-patches.md). A mean has no defence against one sender: an
invited peer whose gradient is its honest one times -8 turns the mean of 3 peers uphill ((g + g - 8g) / 3 =
-2g) while staying within the round screen's 10x (swarm/averaging/screen.py); in the demo the honest
peers' val acc fell from 0.90 to 0.11 within 20 s. A sender that announces a weight of 10^6 makes the mean
its own vector, of an honest size.

**What this changes.** :class:`RobustPartReducer` keeps each sender's part of the current slice and reduces
them with :func:`centered_clip` (CenteredClip, Karimireddy et al. 2021, as BTARD runs it inside the butterfly
all-reduce, Gorbunov et al. 2022): starting from the coordinate-wise median of the parts, it moves toward each
part by at most ``tau`` per iteration. ``tau`` is ``TAU_FACTOR`` (1.5) times the median distance to that start
of the nearest majority of parts (the ``n // 2 + 1`` nearest of ``n``): colluders that are fewer than half
cannot raise it, where the median of all the distances can be the largest honest one (honest gradients of
small batches differ in norm several times over: up to 10 times within one slice in the demo's late rounds,
and with tau from the largest, two x-8 colluders of five lay within 2 tau and turned rounds uphill). No
sender's weight (its samples of the round, as it announces them) counts for more than the round's median
weight (``WEIGHT_CAP``): with a cap of 2 or 4, one sender that announced 10^6 samples still turned the result
of 3 uphill. Where no part is further than ``tau`` from the weighted mean, the result is that mean, up to
float rounding: random parts of 1,000 numbers or more are about equally far from their mean (at most 1.19
times the distance above, for 3 to 8 parts with weights from 0.5 to 1.5), so a round of honest gradients of
one norm gives what hivemind gives, except that a peer with more than the median's samples counts as the
median; an honest part of a larger norm is clipped (its pull bounded by ``tau``). Parts further than 2
``tau`` from the median (scaled below ``CUT``) take no part at all, unless they are among the nearest
majority (by count: colluders can announce the median's samples), and not in a slice of fewer than
``CUT_NUMBERS`` numbers (in a few numbers, honest parts can lie far apart): clipped only, two parts of five
far outside pulled the result by up to 0.4 ``tau`` every round. With two senders it is always the weighted
mean: a robust rule cannot outvote one of two. Where most parts are equal (the parameters of peers in step,
in a state round), it is their value.

**Who is attacking.** The reducer also judges senders (swarm/suspects.py): in a gradient averager's
process by the scale the rule gave their parts and by the cosine of their parts with this peer's own
(:func:`directions`); in a state averager's process where the peers hold one state, by the distance of their
parameters' parts from this peer's own (:func:`judge_states_here`).

The reducer runs in the averager processes, which inherit :data:`RULE` when they fork: :func:`use` sets it
("centered_clip", the default, or "mean", hivemind's own) before the averagers start.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from typing import Any

import torch

from swarm.config import AGGREGATION as RULES
from swarm.patches._registry import Patch
from swarm.suspects import STATE_FAR, SUSPECT_SCALE, Suspects

log = logging.getLogger(__name__)
RULE = "centered_clip"  # read by the reducers of averager processes forked after use()
TAU_FACTOR = 1.5  # tau: this many times the median distance of the parts to their coordinate-wise median
WEIGHT_CAP = 1.0  # no sender's weight counts for more than this many times the round's median weight
ITERATIONS = 20  # at most; it stops once the centre moves by less than TOLERANCE of tau
TOLERANCE = 1e-4
FAR_FROM_OWN = 3.0  # a sender's parts this many times the own part's norm from it: noted (swarm/suspects.py)
CUT = 0.5  # a part scaled below this (further than 2 tau from the centre) takes no part in the result,
CUT_NUMBERS = 1000  # in a slice of at least this many numbers (where honest parts lie about equally far)
_clipped: Any = None  # mp.Value: senders' parts scaled down by this process's averagers (forked: shared)
_suspects: Any = None  # swarm.suspects.Suspects, shared by the averager processes forked after install
_SCORING = False  # True in a gradient averager's process: its reducers judge senders (score_senders_here)
_STATES = False  # True in a state averager's process where peers hold one state (judge_states_here)


def use(rule: str) -> None:
    """The rule that averager processes started from now on reduce with."""
    global RULE
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; use one of {', '.join(RULES)}")
    RULE = rule


def _median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the rows (the mean of the two middle values for an even count). Groups are
    small: an odd-even transposition network of elementwise min/max sorts 4 rows of 131,072 numbers in
    0.5 ms, where ``torch.sort`` along the rows takes 9 ms."""
    n = parts.shape[0]
    if n > 16:
        ordered = list(parts.sort(dim=0).values)
    else:
        ordered = list(parts.unbind(0))
        for i in range(n):
            for j in range(i % 2, n - 1, 2):
                low, high = ordered[j], ordered[j + 1]
                ordered[j], ordered[j + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def capped_weights(weights: torch.Tensor, cap: float = WEIGHT_CAP) -> torch.Tensor:
    """``weights`` with none above ``cap`` times the median of the positive ones (zero stays zero)."""
    positive = weights[weights > 0]
    if positive.numel() == 0:
        return weights
    return weights.clamp(max=cap * float(_median(positive.unsqueeze(1)).item()))


def centered_clip(
    parts: torch.Tensor,
    weights: torch.Tensor,
    tau_factor: float = TAU_FACTOR,
    iterations: int = ITERATIONS,
    tolerance: float = TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(The robust average of the rows of ``parts`` (n x d, float32) with ``weights`` (n), the factor each
    row was scaled by at the last iteration: 1 where it was not clipped; for a row left out, ``tau`` over its
    distance from the result). Rows with weight 0 take no part.

    Where every row lies within ``tau`` of the weighted mean (an honest round), the mean is the fixed point of
    the iteration (no row clipped, so its step is zero) and is returned at once: the iteration from the median
    reaches it too, to within ``tolerance``, in two or more passes over the rows (measured on one core: 3 rows
    of 131,072 numbers 0.73 against 0.49 ms, 4 rows 1.01 against 0.70, 8 rows 4.8 against 3.1)."""
    weights = weights.to(torch.float32)
    used = weights > 0
    scale = torch.ones(parts.shape[0])
    if int(used.sum()) == 0:
        return torch.zeros(parts.shape[1:], dtype=parts.dtype), scale
    rows, w = (parts, weights) if bool(used.all()) else (parts[used], weights[used])
    rows = rows.to(torch.float32)
    if rows.shape[0] <= 2:  # nothing to outvote: the weighted mean
        return ((w @ rows) / w.sum()).to(parts.dtype), scale
    w = capped_weights(w, WEIGHT_CAP)
    total = w.sum()
    centre = _median(rows)
    distances = torch.linalg.vector_norm(rows - centre, dim=1)
    tau = tau_factor * _majority_distance(distances)
    if tau <= 0:  # most rows agree exactly (parameters of peers in step): their value; the others count 0
        scale[used] = (distances == 0).to(scale.dtype)
        return centre.to(parts.dtype), scale
    mean = (w @ rows) / total
    if bool((torch.linalg.vector_norm(rows - mean, dim=1) <= tau).all()):
        return mean.to(parts.dtype), scale
    far = (distances * CUT > tau) & ~_nearest_majority(distances)
    if rows.shape[1] >= CUT_NUMBERS and bool(far.any()):
        # the parts far outside: no pull at all (clipped, each still pulls by up to tau, and two attackers of
        # five moved the result by up to 0.4 tau every round); the others' centre, from the median
        centre, clip = _iterate(rows[~far], w[~far], centre, tau, iterations, tolerance)
        away = torch.linalg.vector_norm(rows[far] - centre, dim=1).clamp(min=1e-30)
        index = used.nonzero().squeeze(1)
        scale[index[~far]], scale[index[far]] = clip, (tau / away).clamp(max=1.0)
        return centre.to(parts.dtype), scale
    centre, clip = _iterate(rows, w, centre, tau, iterations, tolerance)
    scale[used] = clip
    return centre.to(parts.dtype), scale


def _nearest_majority(distances: torch.Tensor) -> torch.Tensor:
    """Which rows are the ``n // 2 + 1`` nearest of ``n``: a majority by count, not by weight (two colluders
    of five that announce the median's samples, with honest peers of smaller batches, hold more than half
    of the capped weight: kept until the nearest held more than half the weight, one of them was, and rounds
    pointed against the honest parts' mean, cosine -0.32)."""
    keep = torch.zeros_like(distances, dtype=torch.bool)
    keep[distances.argsort()[: distances.shape[0] // 2 + 1]] = True
    return keep


def _majority_distance(distances: torch.Tensor) -> float:
    """The median of the smallest ``n // 2 + 1`` of ``n`` distances: of a strict majority's. Colluders
    that are fewer than half cannot raise it above the median honest distance however far they lie (the
    median of all ``n`` can be the largest honest one: with two attackers of five, the honest gradient of
    the largest norm, which in a small batch is often several times the others')."""
    return float(_median(distances[_nearest_majority(distances)].unsqueeze(1)))


def _iterate(
    rows: torch.Tensor, w: torch.Tensor, centre: torch.Tensor, tau: float, iterations: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CenteredClip's iteration from ``centre``: (the centre, each row's clip factor at the last pass)."""
    total = w.sum()
    clip = torch.ones_like(w)
    for _ in range(iterations):
        diff = rows - centre
        clip = (tau / torch.linalg.vector_norm(diff, dim=1).clamp(min=1e-30)).clamp(max=1.0)
        step = (w * clip / total) @ diff
        centre = centre + step
        if float(torch.linalg.vector_norm(step)) <= tolerance * tau:
            break
    return centre, clip


def _judged_scales(scale: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The scales by which senders are judged (swarm/suspects.py): a sender with fewer samples than
    the round's median sends a noisier gradient, further from the others by about the square root of the
    ratio, and its scale is divided by that root (at most 1). A sender that announces few samples to escape
    judgement pulls the mean that much less."""
    share = _shares(weights)
    return scale if share is None else (scale / share.sqrt()).clamp(max=1.0)


def _shares(weights: torch.Tensor) -> torch.Tensor | None:
    """Each sender's weight over the round's median positive weight, at most 1 (None if no weight is
    positive): the noise of a smaller batch is larger by the square root of its inverse."""
    positive = weights[weights > 0]
    if positive.numel() == 0:
        return None
    return (weights / _median(positive.unsqueeze(1))).clamp(min=1e-12, max=1.0)


def _reducer_class(counter: Any) -> type:
    from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

    class RobustPartReducer(TensorPartReducer):
        """hivemind's reducer that keeps each sender's part of the current slice and reduces them with
        :data:`RULE` once all have arrived (or failed)."""

        def reset_accumulators(self) -> None:
            self._kept: list[tuple[torch.Tensor, float, int]] = []
            # per sender index: (sum of the scales of its parts, parts) in this round, where 3 or more sent
            self.__dict__.setdefault("sender_scales", {})
            # per sender index: (sum over its parts of their distance from this peer's own part, over the own
            # part's norm; parts), where 3 or more sent
            self.__dict__.setdefault("sender_far", {})
            # per sender index, in a state round: (its parts' squared distance from this peer's own parts,
            # the own parts' squared norm), summed over the round, where 3 or more sent
            self.__dict__.setdefault("state_gaps", {})
            # per sender index: (the dot product of its parts with this peer's own parts, their squared norm,
            # the own parts' squared norm, the sum of the squares of their products number by number, the
            # numbers compared), summed over the round, where 2 or more sent
            self.__dict__.setdefault("sender_dirs", {})
            super().reset_accumulators()

        async def accumulate_part(
            self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
        ) -> torch.Tensor:
            # hivemind's accumulate_part (partition.py:218-246), keeping the part instead of adding it
            assert 0 <= sender_index < self.num_senders, "invalid sender index"
            assert 0 <= part_index < self.num_parts, "invalid part index"
            self.num_parts_received[sender_index] += 1
            while part_index > self.current_part_index:
                await asyncio.wait(
                    {self.current_part_future, asyncio.create_task(self.finished.wait())},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if self.finished.is_set():
                    raise AllreduceException("attempted to aggregate part in a finalized TensorPartReducer")
            if self.sender_failed_after[sender_index] != float("inf"):
                raise BannedException(f"sender {sender_index} was banned in background")
            assert part_index == self.current_part_index
            current_part_future = self.current_part_future
            if part_index < self.sender_failed_after[sender_index]:
                self._kept.append((tensor_part, float(weight), sender_index))
                self.current_part_accumulated_from += 1
                self.denominator += weight
                self.check_current_part_finished()
            return await current_part_future

        def check_current_part_finished(self) -> None:
            assert self.current_part_accumulated_from <= self.num_current_senders
            if self.current_part_accumulated_from != self.num_current_senders:
                return
            shape = self.part_shapes[self.current_part_index]
            kept = self._kept
            if not kept:
                result = torch.zeros(shape)
            elif RULE == "mean":
                result = sum(t.to(torch.float32) * w for t, w, _ in kept) / self.denominator
            else:
                parts = torch.stack([t.reshape(-1).to(torch.float32) for t, _, _ in kept])
                weights = torch.tensor([w for _, w, _ in kept])
                flat, scale = centered_clip(parts, weights)
                clipped = int((scale < 1).sum())
                if clipped and counter is not None:
                    with counter.get_lock():
                        counter.value += clipped
                if len(kept) >= 2 and _SCORING and float(weights.min()) > 0:
                    # directions, in rounds of two as well: a cosine with this peer's own part needs no third
                    self._measure_directions(parts, [sender for _, _, sender in kept])
                if len(kept) >= 3 and float(weights.min()) > 0:
                    judged = _judged_scales(scale, weights).tolist()
                    for (_, _, sender), factor in zip(kept, judged, strict=True):
                        total, count = self.sender_scales.get(sender, (0.0, 0))
                        self.sender_scales[sender] = (total + factor, count + 1)
                    if _SCORING:  # a gradient averager's senders are judged by scale
                        self._measure_from_own(parts, weights, [sender for _, _, sender in kept])
                if len(kept) >= 3 and _STATES and self._a_parameter(self.current_part_index):
                    # a state averager's senders, by distance (parameters only: optimizer statistics differ
                    # by much more after a peer stepped alone for a few epochs)
                    self._measure_state_gaps(parts, [sender for _, _, sender in kept])
                result = flat.reshape(shape)
            self.current_part_future.set_result(result)
            self.reset_accumulators()

        def _measure_from_own(self, parts: torch.Tensor, weights: torch.Tensor, senders: list[int]) -> None:
            """Each sender's part's distance from this peer's own part, over the own part's norm; a sender
            with fewer samples than the round's median is allowed the larger noise of its smaller batch (the
            distance is divided by the square root of the ratio, as its scale is in ``_judged_scales``)."""
            mine = self._own_part(parts, senders)
            if mine is None:
                return
            norm, share = float(torch.linalg.vector_norm(mine)), _shares(weights)
            if norm <= 0 or share is None:
                return
            distances = torch.linalg.vector_norm(parts - mine, dim=1) / norm * share.sqrt()
            for sender, distance in zip(senders, distances.tolist(), strict=True):
                total, count = self.sender_far.get(sender, (0.0, 0))
                self.sender_far[sender] = (total + distance, count + 1)

        def _measure_directions(self, parts: torch.Tensor, senders: list[int]) -> None:
            """Each sender's part's dot product with this peer's own part, both squared norms, the sum of
            the squares of their products number by number (the dot product's variance, were the sender's
            signs unrelated to this peer's) and the part's size."""
            mine = self._own_part(parts, senders)
            if mine is None:
                return
            own, size = float(mine.square().sum()), mine.numel()
            products = parts * mine
            dots, squares = products.sum(dim=1).tolist(), parts.square().sum(dim=1).tolist()
            spreads = products.square().sum(dim=1).tolist()
            for sender, dot, square, spread in zip(senders, dots, squares, spreads, strict=True):
                d, s, o, v, n = self.sender_dirs.get(sender, (0.0, 0.0, 0.0, 0.0, 0))
                self.sender_dirs[sender] = (d + dot, s + square, o + own, v + spread, n + size)

        def _own_part(self, parts: torch.Tensor, senders: list[int]) -> torch.Tensor | None:
            """This peer's own row of ``parts`` (one per index in ``senders``); None if it sent none."""
            names, own = self.__dict__.get("sender_peer_ids"), self.__dict__.get("own_peer_id")
            if names is None or own is None or own not in names or names.index(own) not in senders:
                return None
            return parts[senders.index(names.index(own))]

        def _a_parameter(self, part_index: int) -> bool:
            parameters = self.__dict__.get("parameter_parts")
            return parameters is not None and part_index < len(parameters) and parameters[part_index]

        def _measure_state_gaps(self, parts: torch.Tensor, senders: list[int]) -> None:
            """Each sender's squared distance from this peer's own part, and the own part's squared norm."""
            mine = self._own_part(parts, senders)
            if mine is None:
                return
            squares = torch.linalg.vector_norm(parts - mine, dim=1).square().tolist()
            norm = float(torch.linalg.vector_norm(mine).square())
            for sender, square in zip(senders, squares, strict=True):
                gap, total = self.state_gaps.get(sender, (0.0, 0.0))
                self.state_gaps[sender] = (gap + square, total + norm)

        def finalize(self) -> None:
            if not self.finished.is_set():
                _judge_senders(self)
                _judge_states(self)
            super().finalize()

    RobustPartReducer.__name__ = RobustPartReducer.__qualname__ = "TensorPartReducer"
    return RobustPartReducer


def score_senders_here() -> None:
    """Called in a gradient averager's process as it starts: its reducers judge the senders of each round
    (swarm/suspects.py) by the scales the rule gave their parts. State rounds are judged by distance
    (:func:`judge_states_here`)."""
    global _SCORING
    _SCORING = True


def judge_states_here() -> None:
    """Called in a state averager's process as it starts, where the peers are meant to hold one state
    (gradient averaging): its reducers judge the senders' states by their distance from this peer's own
    (swarm/suspects.py)."""
    global _STATES
    _STATES = True


def state_gaps(reducer: Any) -> dict[str, float]:
    """After a state round: each groupmate's distance from this peer's own state over the slice this peer
    reduced, over the own slice's norm (by base58 PeerID; empty where fewer than 3 sent)."""
    gaps, senders = reducer.__dict__.get("state_gaps"), reducer.__dict__.get("sender_peer_ids")
    if not gaps or not senders:
        return {}
    out = {}
    for index, (square, total) in gaps.items():
        if senders[index] != reducer.own_peer_id:
            gap = (square / total) ** 0.5 if total > 0 else (float("inf") if square > 0 else 0.0)
            out[str(senders[index])] = gap
    return out


def directions(reducer: Any) -> dict[str, tuple[float, float, int]]:
    """After a gradient round of two or more senders, for each groupmate (by base58 PeerID; empty where this
    peer sent none), over the slice this peer reduced: the cosine between its parts and this peer's own;
    their dot product in standard deviations of what it would be were its signs unrelated to this peer's
    (``dot / sqrt(sum((mine_i * its_i)^2))``: about normal with a variance of 1 for a random direction,
    however its size is spread over the numbers); the slice's size."""
    dirs, senders = reducer.__dict__.get("sender_dirs"), reducer.__dict__.get("sender_peer_ids")
    if not dirs or not senders:
        return {}
    out = {}
    for index, (dot, square, own, spread, size) in dirs.items():
        if senders[index] != reducer.own_peer_id and square > 0 and own > 0:
            z = dot / spread**0.5 if spread > 0 else 0.0
            out[str(senders[index])] = (dot / (square * own) ** 0.5, z, size)
    return out


def _judge_states(reducer: Any) -> None:
    """After a state round: each groupmate whose state lay further than ``STATE_FAR`` times this peer's own
    state's norm from it gets a far state round; the others' run of far rounds ends. Only if some groupmate's
    state lay near this peer's: a peer whose own state went astray judges nobody."""
    if not (_STATES and _suspects is not None):
        return
    gaps = state_gaps(reducer)
    log.debug("State round: groupmates' distances from this peer's state %s", gaps)
    if not any(gap <= STATE_FAR for gap in gaps.values()):
        return
    for peer, gap in gaps.items():
        if _suspects.noted_state(peer, gap):
            log.debug("Banned %s: its state lay %.2f times this peer's norm away", peer, gap)


def _judge_senders(reducer: Any) -> None:
    """After a round (``reducer`` finished, for a runner that named its senders): each groupmate whose parts
    this peer reduced gets one judged round: the average scale of its parts. Unless this peer's own parts
    were clipped too (below SUSPECT_SCALE): then the round's centre was not the honest peers' (two colluding
    attackers in a group of three are its majority, and the rule scales the honest one down and them not at
    all), and the round judges nobody."""
    senders = reducer.__dict__.get("sender_peer_ids")
    if not (_SCORING and senders and _suspects is not None):
        return
    # the direction is judged in every round of two or more: it compares with this peer's own part, not with
    # the round's centre, so colluders that own a round cannot make theirs look close
    for peer, (cosine, z, size) in directions(reducer).items():
        if _suspects.noted_direction(peer, cosine, z, size):
            log.debug("Banned %s: its gradients pointed against, or were unrelated to, this peer's own", peer)
    scales = reducer.__dict__.get("sender_scales")
    if not scales:
        return
    for index, (total, count) in reducer.__dict__.get("sender_far", {}).items():
        if senders[index] != reducer.own_peer_id and count and total / count > FAR_FROM_OWN:
            _suspects.noted_far(str(senders[index]))  # the round screen decides (swarm/suspects.py)
    own = [total / count for index, (total, count) in scales.items() if senders[index] == reducer.own_peer_id]
    if own and own[0] < SUSPECT_SCALE:
        return
    for index, (total, count) in scales.items():
        if senders[index] != reducer.own_peer_id and count:
            _suspects.record(str(senders[index]), total / count)


def _targets() -> list[tuple[Any, str, Any]]:
    """Count from now on; the averager processes started afterwards inherit the counter and the suspects."""
    global _clipped, _suspects
    from hivemind.averaging import allreduce
    from hivemind.compression import TensorRole

    if _clipped is None:
        _clipped = mp.get_context("fork").Value("q", 0)
    if _suspects is None:
        _suspects = Suspects()
    init = allreduce.AllReduceRunner.__init__

    def init_naming_senders(self: Any, *args: Any, **kwargs: Any) -> None:
        """hivemind's ``AllReduceRunner.__init__``; its reducer learns who the senders are (to judge them)."""
        init(self, *args, **kwargs)
        reducer = self.tensor_part_reducer
        reducer.sender_peer_ids, reducer.own_peer_id = list(self.sender_peer_ids), self.peer_id
        # whether each part this peer reduces is a parameter's (not an optimizer statistic's): hivemind splits
        # every peer's tensors alike, and this peer's own parts are the ones it reduces (partition.py:73-95)
        own = self.tensor_part_container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        reducer.parameter_parts = [info.role == TensorRole.PARAMETER for _, info in own]

    return [
        (allreduce, "TensorPartReducer", _reducer_class(_clipped)),
        (allreduce.AllReduceRunner, "__init__", init_naming_senders),
    ]


def suspects() -> Any:
    """This peer's :class:`swarm.suspects.Suspects` (None before the patch was first installed)."""
    return _suspects


def clipped_parts() -> int:
    """Senders' parts that this peer's averagers scaled down as reducers (a part of a slice further than
    ``tau`` from the robust centre), since the patch was first installed; 0 if never. An honest swarm of
    many-numbered slices has none."""
    return 0 if _clipped is None else int(_clipped.value)


PATCH = Patch("robust", _targets)
