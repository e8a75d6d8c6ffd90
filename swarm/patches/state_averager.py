"""The state averager (hivemind/optim/state_averager.py): what a newcomer downloads, and what a state round
applies.

**What hivemind does.** ``TrainingStateAverager`` averages the parameters (and chosen optimizer statistics)
in state rounds and serves them to newcomers. ``get_current_state`` (state_averager.py:627-656) hands the live
tensors to the averager process, which serializes them after the lock is released, and hivemind.Optimizer
runs the local update without that lock (``reuse_tensors=False``). It numbers a new epoch before the update
and the state round that make it (``step``, state_averager.py:329, then ``_do``). ``_do`` uses one ``timeout``
both as the matchmaking deadline and as the wait for the round's result. The averager stores its donor record
in the DHT at every change of ``state_sharing_priority`` (averager.py:600-625), and hivemind.Optimizer changes
it at every global epoch (optimizer.py:502). With ``sync_epoch_when_averaging`` (state_averager.py:558) every
member of a state round takes the largest epoch it gathered, whatever its size.

**What goes wrong, and what this changes** (items of docs/hivemind-patches.md):

- item 4: a download could catch a donor's update half-applied, or the new epoch's number with the old
  tensors, or (while the donor loads a download of its own) the downloaded tensors with its old epoch's
  number. The state is served only once the epoch's step or the download has ended (and been judged),
  copied under the lock, and copied again when a step or download began while it copied;
  :func:`lock_updates` holds the lock while the optimizer updates.
- item 7: an averaged state and a download are judged by the peer's round screen before they are applied
  (its ``screen`` and ``on_rejected`` attributes); a download is judged whole (the optimizer's state dict
  included, at any epoch), and never changes the optimizer's hyperparameters.
- item 9: a groupmate's malformed or far-ahead epoch would move this peer: :func:`sane_epochs`.
- item 12: a state round looks for its group for at most ``find_group_within`` seconds from the moment it is
  asked for, while the round itself keeps ``allreduce_timeout``.
- item 13: a download notes the epoch of the state it holds (``held_epoch``).
- item 18: a donor stores a changed epoch at most every ``DECLARE_EVERY`` seconds.
- item 3: one all-reduce buffer per dtype and role (swarm/patches/allreduce.py).
- item 23: a download is checked against what the rest of the swarm holds at its epoch (``check_download``,
  set by the strategy): the downloader asks one donor at a time, newest first, and a state that other peers
  contradict is undone and taken from the next donor instead. :func:`state_sketch` is what peers compare.
- item 24: a refused donor's epoch does not make this peer download again (``refused_donors``, read by
  swarm/patches/optimizer.py ``decide_downloads_after_refusals``).
- item 29: a downloaded state that is not whole (fewer tensors than its metadata names, or of other shapes)
  is dropped before hivemind applies it (:func:`_not_whole`), and its donor refused.
- item 25: a download notes whether a donor answered it (``donor_answered``): a state arrived (hivemind's
  ``DecentralizedAverager.load_state_from_peers`` returned one to ``TrainingStateAverager``,
  state_averager.py:667-674) and neither the screen nor the check undid it; hivemind applies it, or keeps
  this peer's own state where the donor's is older. Where this peer chose the donor (item 23) it notes which
  (``answered_by``); :meth:`declared_donors` says which peers declare themselves donors.
- item 32: a donor that cannot be dialled (it left; its record lingers in the DHT), or that refuses this peer
  because it bans it (swarm/patches/rpc_guard.py), is passed over for the next one in the same download, and
  named in ``unreachable`` (read by swarm/patches/optimizer.py).
- item 31: hivemind takes a download from one donor, as slow as that donor's upload. With the check and
  ``download_donors`` > 1, the donor sends the parameters and other donors at its epoch send the extras and
  the optimizer's statistics, in slices at the same time (``rpc_download_state_part``); a slice that fails or
  comes from another epoch is asked of the donor, and a state put together that the screen or the check
  refuses is asked of the donor alone.
- item 37: hivemind waits for a download at most ``load_state_timeout`` in all (averaging/averager.py:682),
  then gives up and asks again, while the first download goes on in the averager process and competes with the
  second for the donors' uplinks. A download from a donor this peer chose (item 23) notes each chunk as it
  arrives (``_swarm_last_chunk``, shared with the averager process), and is waited for while its chunks keep
  coming, up to ``DOWNLOAD_CAP`` times ``load_state_timeout``.
- item 33: where ``keeps_own_extras`` says the extras are each peer's own (DiLoCo's inner moments), a peer
  that holds a state of its own (``holds_own_state``: it took an epoch's step or a download) downloads the
  parameters and the optimizer's statistics alone, and its own extras complete the state before hivemind
  applies it (:meth:`_with_own_extras`).
- item 40: where the extras are each peer's own (``own_extras``, known when the averager is built, before its
  process forks), they stay out of the state rounds too: hivemind averages every tensor it shares
  (optim/state_averager.py:264-272), and DiLoCo's inner moments are two of the four copies of the model that
  a DiLoCo state round sent. A round leaves each peer its own extras as they are at its end.

:func:`install` makes hivemind.Optimizer build this class (it reads the module-level name
``TrainingStateAverager`` of optim/optimizer.py:284). The class keeps hivemind's name: the p2p handlers'
names are built from the class name, and must match those of other peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from functools import cache
from typing import Any

import torch

from swarm.patches import robust, rpc_guard
from swarm.patches._registry import Patch
from swarm.patches.allreduce import PacksParts

log = logging.getLogger(__name__)
DECLARE_EVERY = 5.0  # item 18: seconds between two of a donor's declarations that only change its epoch
DONORS_TRIED = 3  # item 23: donors asked in one download at most
REFUSE_FOR = 300.0  # item 23: seconds for which a donor whose state was refused is not asked again
# item 37: a download whose chunks keep coming is waited for past load_state_timeout, up to this many times it
DOWNLOAD_CAP = 4
# item 31: a helper donor (one that sends a slice) may declare an epoch this much older than the donor it
# helps: a donor stores a changed epoch at most every DECLARE_EVERY seconds (item 18), so one declared epoch
# behind is often the same state; the epochs that the slices arrive with are what is compared
HELPER_EPOCHS_BEHIND = 1
MAX_PARTS = 8  # item 33: slices that one request for parts of the state may name
KEPT = "swarm-own-extras"  # item 33: the mark of a download that left this peer's extras out
SKETCH_COLUMNS, SKETCH_DIRECTIONS = 1024, 4  # item 23: a state folded into 1024 sums, then 4 projections
_ROLE_NAMES = {"PARAMETER": "parameters", "OPTIMIZER": "optimizer statistics"}


class Unreachable:
    """Item 32: what the averager process answers a download whose donor could not be dialled, or refused
    this peer as one it bans."""

    def __init__(self, why: str) -> None:
        self.why = why


def _dial_failed(exc: BaseException) -> bool:
    """Item 32: whether ``exc`` says that the p2p daemon could not dial the peer at all (every address refused
    or in dial backoff, or none known): the peer is gone, or its address changed. A stream cut short or a
    timeout is not this: the peer was there."""
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    return isinstance(exc, ControlFailure) and "failed to dial" in str(exc)


def _roles(averager: Any) -> list[str]:
    """What each of a state averager's tensors is, as the screen names it (item 7)."""
    return [_ROLE_NAMES.get(info.role.name, "extra tensors") for info in averager.tensor_infos]


def _changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    """Whether a download changed any of these tensors (or their number)."""
    return len(before) != len(after) or any(
        a.shape != b.shape or not torch.equal(a, b.to(a.device)) for a, b in zip(before, after, strict=True)
    )


def sane_epochs(gathered: dict, own_id: Any) -> dict:
    """The epochs that a state averaging round gathered (item 9), each one an int from this peer's own epoch
    up to one more: a groupmate's malformed or far-ahead epoch must not move this peer (one that is further
    ahead hands its state over through hivemind's catch-up download instead)."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    own = gathered.get(own_id)
    if not is_int(own):
        return {}
    return {peer: min(e, own + 1) if is_int(e) and e > own else own for peer, e in gathered.items()}


@cache
def _sketch_directions() -> torch.Tensor:
    """The fixed random directions of :func:`state_sketch` (every peer draws the same)."""
    gen = torch.Generator().manual_seed(20261126)
    return torch.randn(SKETCH_DIRECTIONS, SKETCH_COLUMNS, generator=gen, dtype=torch.float64)


def state_sketch(tensors: list[torch.Tensor]) -> list[float]:
    """Item 23: five numbers that tell states apart: the L2 norm of all ``tensors`` together, then 4 random
    projections of them. Each tensor is folded into ``SKETCH_COLUMNS`` column sums (element i to column
    i mod 1024, rolled by the tensor's index), and the summed folds are projected on 4 fixed random
    directions; each tensor summed in float32 (a quarter of float64's time: 0.4 s for ViT-B/32's 87.5 M
    parameters on one CPU thread), the rest in float64; one pass over each tensor, no copy. Equal states give
    equal sketches (to float32 rounding, about 1e-7 of the norm); two states that differ by a fraction e of
    their norm give projections that differ by about e of the norm, so a state of random numbers of the right
    norm, one with its signs flipped, or another run's, differs by about its whole norm."""
    folded = torch.zeros(SKETCH_COLUMNS, dtype=torch.float64)
    squares = 0.0
    with torch.no_grad():
        for index, tensor in enumerate(tensors):
            flat = tensor.detach().reshape(-1)
            n = flat.numel()
            if n == 0:
                continue
            body = n - n % SKETCH_COLUMNS
            column = torch.zeros(SKETCH_COLUMNS, dtype=torch.float32, device=flat.device)
            if body:
                column += flat[:body].view(-1, SKETCH_COLUMNS).sum(0, dtype=torch.float32)
            if body < n:
                column[: n - body] += flat[body:].to(torch.float32)
            folded += column.cpu().double().roll(index)
            squares += float(torch.linalg.vector_norm(flat, dtype=torch.float32)) ** 2
    return [squares**0.5, *(_sketch_directions() @ folded).tolist()]


def sketch_distance(a: list[float], b: list[float]) -> float:
    """Item 23: how far apart two states' sketches are, as a fraction of the larger norm (0 for equal
    states; about 1 or more for unrelated ones)."""
    scale = max(abs(a[0]), abs(b[0]), 1e-12)
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / scale


class _SettledState:
    """The methods that make the class of :func:`state_averager_class`: see the module docstring."""

    def __init__(
        self: Any,
        *args: Any,
        find_group_within: float | None = None,
        own_extras: bool = False,
        **kwargs: Any,
    ) -> None:
        self._swarm_settled = threading.Event()  # clear in an epoch's step or applying a download (item 4)
        self._swarm_settled.set()
        self._swarm_steps = 0  # epoch steps and downloads begun (item 4)
        self._swarm_busy = 0  # of which still running
        self._swarm_busy_lock = threading.Lock()
        self._swarm_find_group_within = find_group_within  # item 12
        self.screen: Any = None  # item 7: a RoundScreen and its callback, set by swarm.patches.optimizer.wire
        self.on_rejected: Any = None
        self.held_epoch: int | None = None  # item 13: the epoch of the state the last download left here
        self.donor_answered = False  # item 25: a donor's state arrived in the last download, and stands
        self.answered_by: str | None = None  # item 25: that donor (base58), where this peer chose it
        self._swarm_received = False  # item 25: a state arrived in the download under way (_beneath)
        self._swarm_not_whole: str | None = None  # item 29: why the state that arrived was dropped
        self._swarm_unreachable: str | None = None  # item 32: why the donor of this download was not reached
        self.unreachable: dict[str, str] = {}  # item 32: the donors (base58) the last download could not dial
        self._swarm_arrived = False  # item 4: this download's state arrived, and no state is served
        # item 23: a swarm.averaging.donors.DonorCheck, set by the strategy (None: any donor, unchecked); told
        # of refused donors through on_refused(donor, reason); the donors refused lately (base58 -> until)
        self.check_download: Any = None
        self.on_refused: Any = None
        self.refused_donors: dict[str, float] = {}
        self.serve_filter: Any = None  # the bad_donor fault (swarm/faults.py): changes the parameters served
        self.round_filter: Any = None  # the bad_state fault: changes the parameters this peer sends in rounds
        self._swarm_only_donor: bytes | None = None  # item 23, in the averager process: the one donor to ask
        # item 31: at most this many donors send one download, each a slice (1: the whole state from one; the
        # strategy sets the config's download_donors); helpers of a refused download are left out for a while
        self.download_donors = 1
        self.unhelpful: dict[str, float] = {}  # base58 -> monotonic time until which it helps no download
        self._swarm_helpers: list[bytes] = []  # item 31, in the averager process: the slices' other donors
        self._swarm_slices: list[tuple[int, int]] = []  # the slices: [start, stop) of the state's tensors
        # item 33: where the extras are each peer's own (DiLoCo's inner moments: ``own_extras``, which the
        # strategy passes, so it is set before the averager process forks), a peer that holds a state of its
        # own downloads the rest alone; it holds one once it took an epoch's step or a download (the strategy
        # clears it to take a whole state after a fault). Item 40: the extras also stay out of state rounds
        self.keeps_own_extras = own_extras
        self.holds_own_state = False
        self._swarm_kept: tuple[int, int] | None = None  # averager process: [start, stop) not asked for
        # item 37: time.monotonic() of the last chunk of a download, written in the averager process
        self._swarm_last_chunk = mp.Value("d", 0.0, lock=False)
        super().__init__(*args, **kwargs)  # starts the thread that serves the state
        # a donor whose refused state shares nothing with the swarm's is banned only where the peers are meant
        # to hold one state: DiLoCo's peers (extra tensors: their inner moments) hold their groups' anchors,
        # and an honest one lay 1.2 times its norm from the most-published state in the volunteers lab
        self.bans_bad_donors = not self.extra_tensors

    def run(self: Any) -> None:
        # the averager's own process: where the peers are meant to hold one state (no extra tensors: those
        # carry DiLoCo's inner moments, each peer's own), its reducers judge the senders' states
        if not self.extra_tensors:
            robust.judge_states_here()
        super().run()

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind's step; an epoch's step (increment_epoch) is unsettled until it returns. The swarm runs
        it synchronously (no delayed updates or averaging): the update and the state round are done then."""
        if not kwargs.get("increment_epoch"):
            return super().step(*args, **kwargs)
        with self._unsettled():
            result = super().step(*args, **kwargs)
        self.holds_own_state = True  # item 33
        return result

    @contextlib.contextmanager
    def _unsettled(self: Any) -> Any:
        """Item 4: no state is served while this runs (an epoch's step)."""
        self._begin_unsettled()
        try:
            yield
        finally:
            self._end_unsettled()

    def _begin_unsettled(self: Any) -> None:
        with self._swarm_busy_lock:
            self._swarm_busy += 1
            self._swarm_steps += 1
            self._swarm_settled.clear()

    def _end_unsettled(self: Any) -> None:
        with self._swarm_busy_lock:
            self._swarm_busy -= 1
            if self._swarm_busy == 0:
                self._swarm_settled.set()

    def _state_arrived(self: Any) -> None:
        """Item 4: a downloaded state is here and about to be applied: no state is served until the download
        is judged and numbered (``load_state_from_peers`` ends it). Until it arrives this peer's own state
        stands and is served: two peers that start together and download from each other would otherwise
        each wait half of ``next_chunk_timeout`` for the other (5 s at the demo's start)."""
        if not self._swarm_arrived:
            self._swarm_arrived = True
            self._begin_unsettled()

    def get_current_state(self: Any) -> tuple[Any, list[torch.Tensor], list[Any]]:
        """hivemind's get_current_state (optim/state_averager.py:627), once the epoch's step or the download
        has ended, with copies taken under the lock (item 4)."""
        from itertools import chain

        from hivemind.compression import CompressionInfo, TensorRole
        from hivemind.optim.state_averager import dump_optimizer_state

        wait = 0.5 * (self.next_chunk_timeout or 10.0)  # hivemind's downloader waits that long for a part
        deadline = time.monotonic() + wait
        while True:
            if not self._swarm_settled.wait(max(0.0, deadline - time.monotonic())):
                log.info(
                    "Sent no state to a peer: this one was in an epoch's step or a download for %.1f s", wait
                )
                return None, [], []  # no part: the downloader asks the next peer (averager.py)
            begun = self._swarm_steps
            with torch.no_grad(), self.lock_averaged_tensors:
                params = [
                    p.detach().to("cpu", copy=True) for g in self.optimizer.param_groups for p in g["params"]
                ]
                extra = [t.detach().to("cpu", copy=True) for t in self.extra_tensors]
                opt_metadata, opt_tensors = dump_optimizer_state(self.optimizer)
                opt_tensors = [t.clone() for t in opt_tensors]
                epoch = self.local_epoch
            # hivemind numbers the new epoch as the step begins, without the lock (state_averager.py, step):
            # a step that began while this copied can have given the old tensors the new number (in a test,
            # a newcomer announced epoch 37 and held both donors' anchor of 36); copied again once it ended
            if self._swarm_settled.is_set() and self._swarm_steps == begun:
                break
        infos = [
            CompressionInfo.from_tensor(p, key=k, role=TensorRole.PARAMETER)
            for p, k in zip(params, self.parameter_names, strict=True)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extra)
        ]
        infos += [
            CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
            for i, t in enumerate(opt_tensors)
        ]
        if self.serve_filter is not None:
            params = self.serve_filter(params, epoch)
        metadata = dict(epoch=epoch, group_bits=self.get_group_bits(), optimizer_metadata=opt_metadata)
        return metadata, list(chain(params, extra, opt_tensors)), infos

    def _load_local_tensors_into_averager_(self: Any) -> None:
        """hivemind's copy of this peer's tensors into what it sends in state rounds
        (optim/state_averager.py:600); the bad_state fault (swarm/faults.py) then changes the parameters."""
        super()._load_local_tensors_into_averager_()
        if self.round_filter is not None and not self.reuse_tensors:
            count = self._parameter_count()
            with torch.no_grad(), self.get_tensors() as sent:
                bad = self.round_filter([t.detach().cpu().clone() for t in sent[:count]], self.local_epoch)
                for tensor, value in zip(sent[:count], bad, strict=True):
                    tensor.copy_(value)

    async def _run_allreduce_inplace_(
        self: Any, tensors: Any, group_info: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """hivemind's all-reduce of a state round, without the extras where they are this peer's own (item
        40): hivemind lists them last (optim/state_averager.py:272), and their buffers keep what
        ``_load_local_tensors_into_averager_`` put there. Runs in the averager process."""
        own = self._own_extras()
        if 0 < own < len(tensors):
            tensors = list(tensors)[:-own]
            if kwargs.get("tensor_infos") is not None:
                kwargs["tensor_infos"] = list(kwargs["tensor_infos"])[: len(tensors)]
        return await super()._run_allreduce_inplace_(tensors, group_info, *args, **kwargs)

    def _apply_averaging_results_(self: Any) -> None:
        """hivemind's copy of the averaged state into the model, unless the screen rejects it (item 7).
        Extras of this peer's own (item 40) are not copied back (the screen sees them unchanged): the round
        did not average them, and an overlapped DiLoCo peer's inner steps have changed them since it sent its
        state."""
        own = 0 if self.delta_rule_averaging else self._own_extras()
        local = list(self._local_tensors())
        shared = len(local) - own
        if self.screen is not None:
            with torch.no_grad(), self.get_tensors() as averaged:
                # the extras judged as they are (unchanged): their role still tells the screen it is DiLoCo's
                reason = self.screen.judge_state(local, [*averaged[:shared], *local[shared:]], _roles(self))
            if reason is not None:
                self.on_rejected("state", reason, 0)
                return
        if not own:
            super()._apply_averaging_results_()
            return
        with torch.no_grad(), self.get_tensors() as averaged:  # hivemind's copy (state_averager.py:612-616)
            assert len(local) == len(averaged), "Tensor structure changed during training"
            for mine, got in zip(local[:shared], averaged[:shared], strict=True):
                mine.copy_(got, non_blocking=True)

    def _own_extras(self: Any) -> int:
        """Item 40: how many of the last tensors a state round leaves out (this peer's own extras), or 0."""
        return len(self.extra_tensors) if self.keeps_own_extras else 0

    def load_state_from_peers(self: Any, **kwargs: Any) -> Any:
        """hivemind's state download, judged (item 7) and, with ``check_download``, checked against the swarm
        (item 23); ``held_epoch`` then says which epoch the tensors are (item 13). This peer serves no state
        until the download is judged and its epoch set (item 4), from the moment its state arrives
        (``_state_arrived``): hivemind copies the downloaded tensors under the lock but numbers their epoch
        after it (state_averager.py:682-697), and a state that the check would refuse must not be passed
        on."""
        self._swarm_arrived = False
        self.donor_answered, self.answered_by = False, None
        try:
            if self.check_download is None:
                return self._load_screened(**kwargs)
            return self._load_checked(**kwargs)
        finally:
            self.held_epoch = self.local_epoch
            self.holds_own_state = self.holds_own_state or self.donor_answered  # item 33
            if self._swarm_arrived:
                self._swarm_arrived = False
                self._end_unsettled()

    def _declarations(self: Any) -> list[tuple[Any, float]]:
        """The donor records this peer reads in the DHT now: (PeerID, declared epoch), malformed ones left
        out (hivemind's, averager.py:689-702)."""
        from hivemind.p2p import PeerID
        from hivemind.utils import ValueWithExpiration

        found = self.dht.get(f"{self.prefix}.all_averagers", latest=True)
        declared = []
        for key, info in (found.value if found is not None and isinstance(found.value, dict) else {}).items():
            if not (isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)):
                continue
            try:
                declared.append((PeerID(key), float(info.value)))
            except Exception:  # a malformed record
                continue
        return declared

    def declared_donors(self: Any) -> set[str]:
        """Item 25: the peers (base58) that declare themselves donors in the DHT now, this one included."""
        return {peer.to_base58() for peer, _ in self._declarations()}

    def _donors(self: Any) -> list[Any]:
        """Item 23: the donors that declared themselves in the DHT, newest epoch first, without this peer, the
        donors refused lately and the groupmates this peer banned (item 21: its averagers would not call
        them). At one epoch, with the download check, the donors whose published state has the most votes
        first (item 34, ``DonorCheck.margin``: the check would refuse the others), then those whose gradients
        this peer's rounds judged closest to the others' (the average of their last judged scales,
        swarm/suspects.py; 1 for a peer never judged), then in random order, as hivemind's
        (averager.py:689-702): a groupmate whose gradients were clipped round after round, not yet banned, is
        asked last."""
        return [peer for peer, _ in self._ranked_donors()]

    def _ranked_donors(self: Any) -> list[tuple[Any, float]]:
        """:meth:`_donors` with the epoch each declares."""
        import random

        from swarm.patches import robust

        declared = self._declarations()
        now = time.monotonic()
        self.refused_donors = {p: t for p, t in self.refused_donors.items() if t > now}
        suspects = robust.suspects()
        ranked = []
        for peer, epoch in declared:
            name = peer.to_base58()
            if peer == self.peer_id or name in self.refused_donors:
                continue
            held = suspects.get(name) if suspects is not None else None
            if held is not None and held.banned_for > 0:
                continue
            trust = held.recent_scale if held is not None else 1.0
            # item 34: at one epoch, the donors whose state most peers published first (the check keeps those)
            margin = self.check_download.margin(name) if self.check_download is not None else 0
            ranked.append(((epoch, margin, trust, random.random()), peer))
        return [(peer, key[0]) for key, peer in sorted(ranked, key=lambda x: x[0], reverse=True)]

    def _helpers(self: Any, donor: Any, epoch: float, ranked: list[tuple[Any, float]]) -> list[Any]:
        """Item 31: the donors that send slices of ``donor``'s download with it: at most
        ``download_donors - 1``, each declaring ``donor``'s epoch or up to ``HELPER_EPOCHS_BEHIND`` before it,
        none that helped a download refused lately; first those whose records published the state that
        ``donor`` published at their newest common epoch (``check_download.agreeing``: their optimizer
        statistics are the donor's too), then in ``ranked``'s order."""
        now = time.monotonic()
        self.unhelpful = {p: t for p, t in self.unhelpful.items() if t > now}
        if self.download_donors <= 1:
            return []
        helpers = [
            peer
            for peer, declared in ranked
            if peer != donor
            and epoch - HELPER_EPOCHS_BEHIND <= declared <= epoch
            and peer.to_base58() not in self.unhelpful
        ]
        agree = set(self.check_download.agreeing(donor.to_base58(), [h.to_base58() for h in helpers]))
        helpers.sort(key=lambda h: h.to_base58() not in agree)  # stable: ranked's order within each
        return helpers[: self.download_donors - 1]

    def _slices(self: Any, count: int) -> list[tuple[int, int]]:
        """Item 31: this peer's state (the tensors that ``get_current_state`` lists: parameters, extras, the
        optimizer's) cut into at most ``count`` runs of whole tensors of about equal bytes on the wire
        (``state_compression``'s estimate). The first run, the donor's, holds every parameter (the check
        judges the parameters, and they are the donor's own), and more tensors up to its share; the
        helpers' runs hold the rest: the extras and the optimizer's statistics (DiLoCo's outer momentum and
        inner moments: 12 of the 16 bytes per parameter of a DiLoCo state). A donor of the
        same model lists the same tensors."""
        from hivemind.compression import CompressionInfo, TensorRole
        from hivemind.optim.state_averager import dump_optimizer_state

        with torch.no_grad(), self.lock_averaged_tensors:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            _, opt_tensors = dump_optimizer_state(self.optimizer)
            roles = [TensorRole.PARAMETER] * len(params) + [TensorRole.UNSPECIFIED] * len(self.extra_tensors)
            roles += [TensorRole.OPTIMIZER] * len(opt_tensors)
            tensors = [*params, *self.extra_tensors, *opt_tensors]
            sizes = [
                t.numel() * t.element_size()
                * self.state_compression.estimate_compression_ratio(CompressionInfo.from_tensor(t, role=role))
                for t, role in zip(tensors, roles, strict=True)
            ]  # fmt: skip
        share = sum(sizes) / max(count, 1)
        first, done = len(params), sum(sizes[: len(params)])
        while first < len(sizes) and done + sizes[first] <= share:
            done += sizes[first]
            first += 1
        bounds, rest, done = [0, first], sum(sizes[first:]), 0.0
        helpers = count - 1
        for i in range(first, len(sizes) - 1):
            done += sizes[i]
            if len(bounds) - 1 < helpers and done >= rest * (len(bounds) - 1) / helpers:
                bounds.append(i + 1)
        bounds.append(len(sizes))
        return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def _load_checked(self: Any, **kwargs: Any) -> Any:
        """Item 23: ask one donor at a time, newest first (at most ``DONORS_TRIED``); each download is judged
        by the screen, then by ``check_download`` against the state that the other peers published for its
        epoch. A contradicted state is undone, with this peer's own epoch, and its donor is not asked again
        for ``REFUSE_FOR`` seconds; one that shares nothing with the swarm's (further than ``STATE_FAR``)
        also bans its donor from this peer's groups (swarm/suspects.py ``served_far``), where the peers are
        meant to hold one state (``bans_bad_donors``).

        Item 31: with ``download_donors`` > 1, other donors at about the donor's epoch send slices of the
        state at the same time (a volunteer's link downloads several times faster than a donor's uploads). The
        check judges the state put together; if it is refused, its helpers help no download for
        ``REFUSE_FOR`` seconds (which of them sent the bad slice is not known), and the donor is asked alone
        at once, so that only the state it sends itself is held against it."""
        result = None
        self.unreachable = {}
        self.check_download.read()  # which donors publish which state: the order of the donors reads it
        ranked = self._ranked_donors()
        tries = [(peer, epoch, True) for peer, epoch in ranked[:DONORS_TRIED]]
        kept = None  # item 33: the extras, where they are this peer's own and it holds a state
        if self.keeps_own_extras and self.holds_own_state and self.extra_tensors:
            count = self._parameter_count()
            kept = (count, count + len(self.extra_tensors))
        while tries:
            donor, epoch, helped = tries.pop(0)
            name = donor.to_base58()
            helpers = self._helpers(donor, epoch, ranked) if helped and kept is None else []
            slices = self._slices(1 + len(helpers)) if helpers else []
            helpers = helpers[: max(0, len(slices) - 1)]
            asked = (
                [donor.to_bytes()],
                {"helpers": [h.to_bytes() for h in helpers], "slices": slices, "kept": kept},
            )
            self._outer_pipe.send(("_swarm_ask_only", *asked))
            self.check_download.last_gap = None  # set by the check if it refuses this donor's state
            try:
                with self.check_download.watching():
                    result, refused = self._load_screened(check=name, **kwargs)
            finally:
                self._outer_pipe.send(("_swarm_ask_only", [None], {}))
            if self._swarm_unreachable is not None:  # item 32: gone; the next donor, if any
                self.unreachable[name] = self._swarm_unreachable
                continue
            if refused is None:
                self.answered_by = name if self.donor_answered else None
                return result
            if helpers:
                until = time.monotonic() + REFUSE_FOR
                self.unhelpful.update({h.to_base58(): until for h in helpers})
                log.info(
                    "A state put together from the slices of %d donors was refused (%s); asking %s alone",
                    len(helpers) + 1,
                    refused,
                    name,
                )
                tries.insert(0, (donor, epoch, False))
                continue
            self.refused_donors[name] = time.monotonic() + REFUSE_FOR
            gap, suspects = self.check_download.last_gap, robust.suspects()
            if gap is not None and suspects is not None and self.bans_bad_donors:
                suspects.served_far(name, gap)  # a state that shares nothing with the swarm's: a ban
            if self.on_refused is not None:
                self.on_refused(name, refused)
        return result

    async def _swarm_ask_only(
        self: Any,
        donor: bytes | None,
        helpers: list[bytes] = (),
        slices: list[tuple[int, int]] = (),
        kept: tuple[int, int] | None = None,
    ) -> None:
        """Item 23, in the averager process: the next downloads ask only ``donor`` (None: any); item 31: with
        ``helpers``, ``donor`` sends the first of ``slices`` and each helper one of the others; item 33: with
        ``kept``, ``donor`` sends every tensor but those (this peer's own extras)."""
        self._swarm_only_donor = donor
        self._swarm_helpers, self._swarm_slices = list(helpers), [tuple(s) for s in slices]
        self._swarm_kept = None if kept is None else tuple(kept)

    async def rpc_download_state_part(self: Any, request: Any, context: Any) -> Any:
        """Item 31: the tensors ``start`` to ``stop`` (a msgpack dict in ``request.value``) of the state that
        ``rpc_download_state`` would send now, in the same stream format, the metadata (with its epoch) on the
        first message; an empty slice sends the metadata alone. Item 33: with ``parts`` (a list of [start,
        stop]), those slices one after the other, of one copy of the state (``start`` and ``stop`` then name
        the first, for a donor that reads only them). Runs in the averager process; its annotations are set
        by :func:`state_averager_class` (hivemind registers a handler by them)."""
        from hivemind.compression import CompressionInfo
        from hivemind.proto import averaging_pb2
        from hivemind.utils.streaming import split_for_streaming

        if not self.allow_state_sharing:
            return  # as rpc_download_state: the downloader asks another donor
        try:
            asked = self.serializer.loads(request.value)
            parts = asked.get("parts") or [(asked["start"], asked["stop"])]
            parts = [(int(start), int(stop)) for start, stop in parts[:MAX_PARTS]]
        except Exception:  # a malformed request
            return
        if not all(0 <= start <= stop for start, stop in parts):
            return
        metadata, tensors, infos = await self._get_current_state_from_host_process()
        if not metadata:
            return
        if infos is None:
            infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
        for start, stop in parts:
            for tensor, info in zip(tensors[start:stop], infos[start:stop], strict=True):
                compressed = self.state_compression.compress(tensor, info, allow_inplace=False)
                for piece in split_for_streaming(compressed):
                    yield averaging_pb2.DownloadData(tensor_part=piece, metadata=metadata or b"")
                    metadata = None
        if metadata:
            yield averaging_pb2.DownloadData(metadata=metadata)

    async def _swarm_fetch(
        self: Any, peer: Any, timeout: float | None, part: tuple[int, int] | None = None, ranges: Any = None
    ) -> Any:
        """(metadata, tensors) from ``peer``: its whole state (hivemind's ``rpc_download_state``, read as
        averager.py:684-736 reads it), or the slice ``part`` of it (item 31), or the slices ``ranges`` of one
        copy of it (item 33); None if it sent no metadata."""
        from google.protobuf import wrappers_pb2
        from hivemind.compression import deserialize_torch_tensor
        from hivemind.proto import averaging_pb2
        from hivemind.utils.asyncio import aiter_with_timeout
        from hivemind.utils.streaming import combine_from_streaming

        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        if ranges is not None:
            part = ranges[0]
        if part is None:
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        else:
            asked = dict(start=part[0], stop=part[1])
            if ranges is not None:
                asked["parts"] = [list(r) for r in ranges]
            asked = self.serializer.dumps(asked)
            stream = await stub.rpc_download_state_part(wrappers_pb2.BytesValue(value=asked))
        metadata, parts, tensors = None, [], []
        async for message in aiter_with_timeout(stream, timeout=timeout):
            self._swarm_last_chunk.value = time.monotonic()  # item 37: the download goes on
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            if message.tensor_part.dtype or parts:
                parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata else None

    async def _swarm_fetch_slices(self: Any, donor: Any, timeout: float | None) -> Any:
        """Item 31: ``donor``'s state put together from slices that ``donor`` and the helpers send at once,
        or None. A slice that did not come whole, or came with another epoch than ``donor``'s (a helper that
        has stepped on, or not yet), is asked of ``donor`` again; None if ``donor``'s own slice failed or its
        epoch changed in between (the caller downloads the whole state from it instead)."""
        from hivemind.p2p import PeerID

        slices = self._swarm_slices

        async def fetch(peer: Any, part: tuple[int, int]) -> Any:
            try:
                got = await self._swarm_fetch(peer, timeout, part)
            except Exception as exc:  # a helper without this RPC (an older peer), gone, or too slow
                log.debug("Could not download a slice of the state from %s: %r", peer, exc)
                return None
            ok = got is not None and isinstance(got[0], dict) and len(got[1]) == part[1] - part[0]
            return got if ok else None

        peers = [donor, *(PeerID(h) for h in self._swarm_helpers)][: len(slices)]
        got = list(await asyncio.gather(*(fetch(p, s) for p, s in zip(peers, slices, strict=True))))
        if got[0] is None:
            return None
        epoch = got[0][0].get("epoch")
        for i in range(1, len(peers)):  # the donor's own slice fits by definition
            part = slices[i]
            if got[i] is None or got[i][0].get("epoch") != epoch:
                log.debug("A slice of the state from %s did not fit; asking %s for it", peers[i], donor)
                got[i] = await fetch(donor, part)
                if got[i] is None or got[i][0].get("epoch") != epoch:
                    return None
        return got[0][0], [t for _, tensors in got for t in tensors]

    async def _swarm_fetch_all_but(self: Any, peer: Any, timeout: float | None, kept: tuple[int, int]) -> Any:
        """Item 33: ``peer``'s state without its tensors ``kept[0]`` to ``kept[1]``, as (metadata, tensors,
        KEPT): two slices of one copy of its state, in one request; else why they did not come whole (a str:
        a donor without the slice RPC or without ``parts``, a stream cut short). A donor that cannot be
        dialled raises, as a whole download would."""
        try:
            got = await self._swarm_fetch(peer, timeout, ranges=[(0, kept[0]), (kept[1], 2**31)])
        except Exception as exc:
            if _dial_failed(exc):
                raise
            return f"{type(exc).__name__}: {str(exc)[:120]}" if str(exc) else type(exc).__name__
        metadata = got[0] if got is not None and isinstance(got[0], dict) else {}
        entries = metadata.get("optimizer_metadata")
        if not isinstance(entries, list):
            return "no state was sent" if got is None else "its metadata is malformed"
        named = [e for e in entries if isinstance(e, dict) and e.get("type") == "tensor"]
        if len(got[1]) != kept[0] + len(named):  # every parameter and every optimizer tensor it names
            return f"{len(got[1])} tensors came of {kept[0] + len(named)}"
        return metadata, got[1], KEPT

    async def _load_state_from_peers(self: Any, future: Any, timeout: float | None = None) -> None:
        """hivemind's download (averager.py:684-736), from the one donor that ``_swarm_ask_only`` named if
        any (item 23): the same stream and parts, one peer; with helpers named too, in slices from several
        donors at once (item 31), or without this peer's own extras (item 33), and whole from the donor if
        that fails. Runs in the averager process."""
        only = self._swarm_only_donor
        if only is None:
            return await super()._load_state_from_peers(future, timeout=timeout)
        from hivemind.p2p import PeerID

        if timeout is not None:  # as hivemind: a part's timeout, not the whole download's
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        peer = PeerID(only)
        try:
            started, loaded = time.monotonic(), None
            if self._swarm_kept is not None:  # item 33: all but this peer's own extras
                loaded = await self._swarm_fetch_all_but(peer, timeout, self._swarm_kept)
                if not isinstance(loaded, str):
                    log.info(
                        "Downloaded the parameters and optimizer statistics from %s in %.3f s (this peer "
                        "keeps its own extra tensors)",
                        peer,
                        time.monotonic() - started,
                    )
                else:
                    log.info(
                        "The state without its extras did not come from %s (%s); asking it for all of it",
                        peer,
                        loaded,
                    )
                    loaded = None
            elif len(self._swarm_slices) > 1:
                loaded = await self._swarm_fetch_slices(peer, timeout)
                if loaded is not None:
                    log.info(
                        "Downloaded the state from %s and %d other donors at once in %.3f s",
                        peer,
                        len(self._swarm_slices) - 1,
                        time.monotonic() - started,
                    )
                else:
                    log.info("The state did not come in slices from %d donors; asking %s for all of it",
                             len(self._swarm_slices), peer)  # fmt: skip
            if loaded is None:
                loaded = await self._swarm_fetch(peer, timeout)
                if loaded is not None:
                    log.info("Downloaded the state from %s in %.3f s", peer, time.monotonic() - started)
            if loaded is not None:
                future.set_result(loaded)
        except Exception as exc:
            if _dial_failed(exc):  # item 32: the caller asks the next donor
                log.info("Could not reach %s to download the state: %r", peer, exc)
                future.set_result(Unreachable(repr(exc)))
            elif rpc_guard.refused_as_banned(exc):  # item 32: it will not serve this peer until its ban ends
                log.info("%s refused to send its state, as it bans this peer (%s); the next donor", peer, exc)
                future.set_result(Unreachable(repr(exc)))
            else:
                log.info("Could not download the state from %s: %r", peer, exc)
        finally:
            if not future.done():
                future.set_result(None)

    def _load_screened(self: Any, check: str | None = None, **kwargs: Any) -> Any:
        """hivemind's state download (state_averager.py:658-698), judged like an averaging round (item 7):
        hivemind.Optimizer downloads from the peer with the newest epoch whenever this peer falls behind, and
        an attacker that runs ahead would otherwise hand its state over. A download replaces the parameters,
        the extra tensors and the optimizer's whole state dict (``load_optimizer_state``): every tensor of it
        is judged, the ones the state round does not average too (SGD's momentum, DiLoCo's outer momentum),
        and a download at this peer's own epoch as much as a newer one (a repeated download of item 13
        comes at the same epoch). The optimizer's hyperparameters (learning rate, weight decay, betas) stay
        this peer's own: honest peers share them (swarm/net/fingerprint.py) and the schedule sets the rate,
        while a donor's would steer the next updates. A rejected download is undone; the peer keeps its own
        state and takes the newer epoch (so it does not download again at the next step).

        With ``check`` (the donor's PeerID, item 23) the parameters are checked by ``check_download`` too; a
        state that the screen rejects or the check refuses is undone with this peer's own epoch (another donor
        is asked next), and the result is (hivemind's result, why it was refused or None)."""
        from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state

        with torch.no_grad(), self.lock_averaged_tensors:
            before = [t.detach().clone() for t in self._local_tensors()]
            opt_metadata, opt_before = dump_optimizer_state(self.optimizer)
            opt_before = [t.clone() for t in opt_before]
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        epoch = self.local_epoch
        self._swarm_own_hyper = hyper  # put back before hivemind's scheduler catches up (_update_scheduler)
        self._swarm_received, self._swarm_not_whole, self._swarm_unreachable = False, None, None
        result = super().load_state_from_peers(**kwargs)
        received, not_whole = self._swarm_received, self._swarm_not_whole
        reason = refused = None
        with torch.no_grad(), self.lock_averaged_tensors:
            self._restore_own_hyper()  # a download that ended before the scheduler's catch-up
            after = list(self._local_tensors())
            _, opt_after = dump_optimizer_state(self.optimizer)
            # judged only if a state arrived: this peer's own state may change while a download runs (a DiLoCo
            # round in the background lands), and judging that as a download undid it and refused the donor
            changed = self.local_epoch != epoch or _changed(before, after) or _changed(opt_before, opt_after)
            loaded = received and changed
            if loaded and self.screen is not None:
                reason = self.screen.judge_state(
                    before,
                    after,
                    _roles(self),
                    kind="download",
                    wholes={"optimizer state": (opt_before, opt_after)},
                )
            if loaded and check is not None:
                params = after[: self._parameter_count()]
                refused = reason or self.check_download.judge(self.local_epoch, state_sketch(params), check)
            if reason is not None or refused is not None:
                load_optimizer_state(self.optimizer, opt_metadata, opt_before)
                self._swarm_own_hyper = hyper
                if check is not None:
                    self.local_epoch = epoch
                self._update_scheduler()  # its own hyperparameters, then the epoch's scheduled rates
                for mine, now in zip(before, self._local_tensors(), strict=True):
                    now.copy_(mine)
        if reason is not None or refused is not None:
            if not self.reuse_tensors:  # takes the (non-reentrant) tensor lock itself
                self._load_local_tensors_into_averager_()
        if reason is not None and check is None:  # with a check, its caller says why (on_refused)
            self.on_rejected("download", reason, 0)
        self.donor_answered = self.donor_answered or (received and reason is None and refused is None)
        if not_whole is not None:  # item 29: nothing of it was applied
            if check is None:
                log.warning(
                    "Dropped a state downloaded from a peer: %s (a stream cut short, or a donor of another "
                    "model); this peer keeps its own state and asks again at its next download",
                    not_whole,
                )
            else:  # its caller says why (on_refused) and asks the next donor
                refused = f"the state is not whole: {not_whole}"
        return result if check is None else (result, refused)

    def _parameter_count(self: Any) -> int:
        """How many parameter tensors the state begins with (the optimizer's, in its groups' order)."""
        return sum(len(g["params"]) for g in self.optimizer.param_groups)

    def _with_own_extras(self: Any, loaded: tuple) -> tuple:
        """Item 33: a download without the extras (``_swarm_fetch_all_but``'s (metadata, tensors, KEPT)) as
        the whole state, this peer's own extras in their place, so that hivemind applies the donor's
        parameters and optimizer state and leaves the extras as they are."""
        metadata, tensors, _ = loaded
        count = self._parameter_count()
        with torch.no_grad(), self.lock_averaged_tensors:
            own = [t.detach().clone() for t in self.extra_tensors]
        return metadata, [*tensors[:count], *own, *tensors[count:]]

    def _restore_own_hyper(self: Any) -> None:
        """This peer's own hyperparameters back into the optimizer after a download (once per download)."""
        own = self.__dict__.pop("_swarm_own_hyper", None)
        for group, values in zip(self.optimizer.param_groups, own or (), strict=False):
            group.update(values)

    def _update_scheduler(self: Any) -> None:
        """hivemind's catch-up of its own scheduler (if given one) at the end of a download
        (state_averager.py:697-698), after this peer's own hyperparameters are back: the schedule then sets
        the rate of the downloaded epoch, as in hivemind."""
        self._restore_own_hyper()
        super()._update_scheduler()

    async def _aggregate_with_group(self: Any, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        """hivemind's averaging round, with the groupmates' epochs made safe for ``sync_epoch_when_averaging``
        (item 9). Runs in the averager process."""
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        return sane_epochs(gathered, self.peer_id)

    async def _declare_for_download_periodically(self: Any) -> None:
        """hivemind's loop that declares this peer a donor of its state in the DHT (averager.py:600-625),
        storing a changed priority at most once per ``DECLARE_EVERY`` seconds (item 18). Switching sharing
        on or off is stored at once, also while a store is under way. Runs in the averager process."""
        from hivemind.utils import get_dht_time

        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            # the flag is read once: hivemind reads it again after the store, so sharing switched off while it
            # stored was never stored (the record stayed until it expired, declare_state_period later)
            allowed = self.allow_state_sharing
            if allowed or sharing_was_allowed:
                # the priority (the epoch) is read now: a store that waited carries the newest one
                value = self.state_sharing_priority if allowed else None
                store = self.dht.store(
                    download_key,
                    subkey=self.peer_id.to_bytes(),
                    value=value,
                    expiration_time=expiration_time,
                    return_future=True,
                )
                asyncio.create_task(asyncio.wait_for(store, timeout=expiration_time - get_dht_time()))
                sharing_was_allowed = allowed
            stored = time.monotonic()
            self._state_updated.clear()
            try:
                left = max(0.0, expiration_time - get_dht_time())
                await asyncio.wait_for(self._state_updated.wait(), timeout=left)
            except TimeoutError:
                pass
            # a changed priority waits until DECLARE_EVERY after the last store; sharing switched on or off
            # goes at once, also when it comes during that wait (a plain sleep held it up to DECLARE_EVERY)
            resume = stored + DECLARE_EVERY
            while self.allow_state_sharing == sharing_was_allowed and time.monotonic() < resume:
                self._state_updated.clear()
                try:
                    await asyncio.wait_for(self._state_updated.wait(), timeout=resume - time.monotonic())
                except TimeoutError:
                    pass


def _not_whole(averager: Any, loaded: tuple) -> str | None:
    """Why a downloaded ``(metadata, tensors)`` cannot be ``averager``'s state, or None (item 29). hivemind's
    TrainingStateAverager.load_state_from_peers (state_averager.py:658-698) takes the first tensors as the
    parameters and extras and looks the optimizer's up by the indices its metadata names
    (``load_optimizer_state``, :730-739): a stream cut short, or a donor that sends fewer tensors or tensors
    of other shapes, raised an IndexError or a copy error there, which hivemind.Optimizer logs as an ERROR
    with its traceback and retries at once (optimizer.py:693-703), the same donor first."""
    metadata, tensors = loaded if len(loaded) == 2 else (None, None)
    if not isinstance(metadata, dict) or not isinstance(metadata.get("optimizer_metadata"), list):
        return "its metadata is malformed"
    if not isinstance(tensors, list | tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return "what arrived is not a list of tensors"
    mine = [p for group in averager.optimizer.param_groups for p in group["params"]]
    mine += list(averager.extra_tensors)
    if len(tensors) < len(mine):
        return f"{len(tensors)} tensors arrived, fewer than this model's {len(mine)} parameters and extras"
    for i, (own, theirs) in enumerate(zip(mine, tensors[: len(mine)], strict=True)):
        if theirs.shape != own.shape:
            return f"tensor {i} has shape {tuple(theirs.shape)}, this model's {tuple(own.shape)}"
    sent = len(tensors) - len(mine)  # the optimizer's tensors that arrived
    for entry in metadata["optimizer_metadata"]:
        if isinstance(entry, dict) and entry.get("type") == "tensor":
            index = entry.get("index")
            if not isinstance(index, int) or not 0 <= index < sent:
                return f"its optimizer state names tensor {index!r}, and {sent} optimizer tensors arrived"
    return None


def _await_download(averager: Any, future: Any, timeout: float | None) -> Any:
    """Item 37: the result of the download ``future`` (hivemind's MPFuture); after ``timeout`` seconds,
    TimeoutError as hivemind raises it, unless a chunk arrived within the averager's wait for a chunk
    (``next_chunk_timeout``): then it is waited for on, up to ``DOWNLOAD_CAP`` times ``timeout``."""
    if timeout is None:
        return future.result()
    began = time.monotonic()
    # the averager process's wait for a chunk (averager.py:686; request_timeout is read here from its kwargs)
    quiet = averager.next_chunk_timeout or averager.matchmaking_kwargs["request_timeout"]
    while True:
        try:
            return future.result(timeout=0.25)
        except TimeoutError:
            now = time.monotonic()
            alive = began < averager._swarm_last_chunk.value > now - quiet
            if now - began >= DOWNLOAD_CAP * timeout or (now - began >= timeout and not alive):
                raise


def _beneath(averager: type) -> type:
    """``averager`` (hivemind's DecentralizedAverager) with the changes that TrainingStateAverager reaches
    through ``super()``: placed between the two in the class order, it sees their calls in this process.

    - ``step`` (item 12): the round's matchmaking deadline, ``find_group_within`` seconds from the moment the
      round is asked for, set here in the caller's process: hivemind's ``_do`` passes one ``timeout`` both as
      the deadline of the step it sends to the averager process (averaging/averager.py:398, read by
      matchmaking and the retries) and as its own wait for the result (optim/state_averager.py:550); only
      the first is shortened. A deadline set in the averager process as it reads the step counted from then:
      a step that waited in the pipe looked for its group longer.
    - ``load_state_from_peers`` (item 25): notes whether it returned a downloaded state; it sees what
      TrainingStateAverager.load_state_from_peers receives (state_averager.py:667) before that method applies
      the state, or drops it as older than this peer's own (state_averager.py:672); and (item 32) whether the
      donor could not be dialled; (item 33) a download without the extras gets this peer's own there; (item
      37) it waits while the download's chunks keep coming (:func:`_await_download`)."""
    from hivemind.utils import get_dht_time

    def step(self: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        within, now = self._swarm_find_group_within, get_dht_time()
        scheduled = kwargs.get("scheduled_time")
        if scheduled is None:  # as hivemind's step sets it (averaging/averager.py:394-395)
            scheduled = now + self.matchmaking_kwargs["min_matchmaking_time"]
        # hivemind asserts that the round is scheduled before its deadline: a round scheduled further ahead
        # than ``within`` keeps its timeout
        if within is not None and scheduled < now + within:
            timeout = within if timeout is None else min(timeout, within)
        return super(beneath, self).step(*args, timeout=timeout, **kwargs)

    def load_state_from_peers(self: Any, wait: bool = True, timeout: float | None = None) -> Any:
        future = super(beneath, self).load_state_from_peers(wait=False, timeout=timeout)
        if not wait:
            return future
        loaded = _await_download(self, future, timeout)
        if isinstance(loaded, Unreachable):  # item 32: nothing arrived; the caller asks the next donor
            self._swarm_unreachable = loaded.why
            return None
        if isinstance(loaded, tuple) and len(loaded) == 3 and loaded[2] == KEPT:  # item 33
            loaded = self._with_own_extras(loaded)
        if isinstance(loaded, tuple):
            self._swarm_not_whole = _not_whole(self, loaded)
            if self._swarm_not_whole is not None:  # item 29: dropped before hivemind applies any of it
                return None
            self._swarm_received = True
            self._state_arrived()  # item 4: serve nothing until it is applied, judged and numbered
        return loaded

    namespace = {"step": step, "load_state_from_peers": load_state_from_peers}
    beneath = type(averager.__name__, (averager,), namespace)
    beneath.__module__ = __name__
    return beneath


@cache
def state_averager_class(base: type) -> type:
    """``base`` (hivemind's TrainingStateAverager) with every change of the module docstring; it takes two
    more keyword arguments, ``find_group_within`` (item 12) and ``own_extras`` (item 40)."""
    from typing import AsyncIterator  # noqa: UP035 hivemind reads the stream from typing's alias (servicer.py:154)

    from google.protobuf import wrappers_pb2
    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    (averager,) = base.__bases__
    bases = (_SettledState, PacksParts, base, _beneath(averager))
    # hivemind registers a handler by its annotations (p2p/servicer.py:49-85) and keeps the handlers it found
    # on the class it first collected them for: this class collects its own, rpc_download_state_part included
    _SettledState.rpc_download_state_part.__annotations__ = {
        "request": wrappers_pb2.BytesValue,
        "context": P2PContext,
        "return": AsyncIterator[averaging_pb2.DownloadData],
    }
    namespace = {"__module__": __name__, "_rpc_handlers": None, "_stub_type": None}
    return type(base.__name__, bases, namespace)


def lock_updates(state_averager: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Hold ``state_averager``'s tensor lock while ``optimizer`` updates (item 4); returns the hooks."""
    lock = state_averager.lock_averaged_tensors

    def acquire(*args: Any) -> None:
        lock.acquire()

    def release(*args: Any) -> None:
        lock.release()

    return [optimizer.register_step_pre_hook(acquire), optimizer.register_step_post_hook(release)]


def _targets() -> list[tuple[Any, str, Any]]:
    from hivemind.optim import optimizer, state_averager

    return [(optimizer, "TrainingStateAverager", state_averager_class(state_averager.TrainingStateAverager))]


PATCH = Patch("state_averager", _targets)
