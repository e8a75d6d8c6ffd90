"""Suspects: groupmates whose gradients this peer found far from the rest, round after round, and the local
ban that keeps them out of this peer's groups for a while.

Two places judge a groupmate's gradient, one round at a time, each giving it a *scale* from 0 to 1 (1: as
close to the others as an honest gradient is):

- **a reducer** (swarm/patches/robust.py): in a gradient round of three or more senders, the peer that
  reduces a slice knows how far CenteredClip scaled each sender's part down; the sender's scale is the
  average over its parts of the round. A sender with fewer samples than the round's median is allowed the
  larger noise of its smaller batch (its scale is divided by the square root of its share,
  swarm/patches/robust.py ``_judged_scales``). A gradient times -8 (-4) among two honest ones is scaled to
  0.08-0.2 (0.15-0.41), depending on how noisy the honest gradients are.
- **the round screen** (swarm/averaging/screen.py): in a gradient round of two, where no rule can outvote
  the other peer, the average's distance from this peer's own gradient, ``d`` times the screen's reference:
  the other's scale is ``SUSPECT_SCALE * PAIR_SUSPECT / d`` (at most 1), so that a round at the screen's
  ``PAIR_SUSPECT`` (2x) scores 0.35, and a rejected one (3x or more) less than 0.24.

A round scaled below ``SUSPECT_SCALE`` (0.35) is a *clipped round*. One clipped round says little: an honest
gradient is now and then far from its groupmates' (a batch with the few images the model still gets wrong,
late in training). In the multi-peer localhost test (4 honest peers, ~800 judged rounds a run) 0.2-2 % of
the rounds were clipped, the lowest at 0.083, within the range of a gradient times -8; but they came one at a
time, between rounds at 1: the average of a peer's last five judged scales (four at first) never fell below
0.66 in 5 runs (~4,200 judged rounds). An attacker is far from the others round after round: in `bench
--scenario attack` each honest peer banned a gradient times -8 or -4 among 3 peers after 4-8 judged rounds.

State rounds are not judged by scale: a peer that stepped alone for a few epochs differs from a group in
step, and the robust rule then counts it as clipped although it is honest. They are judged by distance:

- **a state that shares nothing with this peer's** (swarm/patches/robust.py): in a state round of three or
  more senders where at least one groupmate's state lies near this peer's own (so that this peer's own
  state is the swarm's, not one gone astray), a reducer notes each sender whose parameters lay further than
  ``STATE_FAR`` (1.0) times its own parameters' norm from them, over the slice it reduced
  (:meth:`Suspects.noted_state`; optimizer statistics are left out: a peer that stepped alone differs there
  by up to 1.2 times). Random numbers of each tensor's own norm lie about 1.41 times away, a model with its
  signs flipped 2 times; honest groupmates' parameters lay at most 0.024 times apart in the attack bench
  until an attack mixed them, 0.3 times after. ``FAR_STATES`` (2) such rounds in a row ban the sender, as
  above: state rounds are held only where some member's state differs, so a peer judges few of them. Only
  where peers are meant to hold one state (gradient averaging): DiLoCo's state rounds carry each peer's own
  inner optimizer moments, which differ honestly, and are not judged.

- **far, in a round the screen rejects**: a robust rule outvotes a minority only; two colluders in a group of
  three (or two of four) make the round's result theirs, and a reducer then judges them close (its own part
  clipped, or nobody clipped: honest and colluding parts about equally far from the median). The reducer
  notes each sender whose parts lay more than ``FAR_FROM_OWN`` (3) times its own part's norm from its own
  part (:meth:`Suspects.noted_far`; honest parts lie about 1.4 times away where their noise is as large as
  their common part, a x-8 flip 7-9 times); when the round screen rejects that round for its distance from
  this peer's own gradient, each groupmate so noted gets a judged round scored as the other of a round of two
  would be (``SUSPECT_SCALE * PAIR_SUSPECT / d``, below 0.24). Honest rounds of three or four never lay more
  than 2.1 times the reference away in the demo and the localhost test (the limit is 3): a peer that two
  colluders hold in their groups bans them instead of rejecting every round.

Scale cannot tell a gradient of an honest size that points the wrong way: CenteredClip among three does not
clip an honest gradient times -1, and the mean of three then moves a third as far as an honest one, or a
random direction of an honest norm. Direction can, over many rounds:

- **against this peer's own gradient** (swarm/patches/robust.py ``directions``): in every gradient round of
  two or more senders, a reducer notes the cosine between each groupmate's parts and its own over the
  slice it reduced (:meth:`Suspects.noted_direction`). One round says little: in a 4-peer demo (900 judged
  rounds, 150 global epochs) honest groupmates' cosines had a median of 0.34, a 1st percentile of -0.36 and
  a minimum of -0.56, and their level falls as training goes on (means of 0.4-0.6 in the first third, 0.05-0.2
  in the last). But an honest gradient is a noisy estimate of the same descent direction as this peer's,
  so its cosine with this peer's own averages zero or more however noisy it is (a smaller batch, late in
  training), and a gradient times -1 averages as far below zero as honest ones lie above it (-0.2 to -0.8
  in the attack bench early on; -0.04 to -0.26 per 20 s late in a run, where honest pairs averaged 0.09 to
  0.34). A groupmate whose last ``DIR_WINDOW`` (16) cosines average ``DIR_BELOW`` (-0.15) or less is banned,
  and so is one whose last ``DIR_SHORT_WINDOW`` (8) average ``DIR_SHORT_BELOW`` (-0.3) or less: a pair may
  share only 4-16 judged rounds in the 60 s of an attack. Over 102 honest pairs (five runs of the attack
  bench and a 4-peer demo of 300 global epochs, about 29,000 judged rounds) the lowest mean of 16 in a row
  was -0.08 and of 8, -0.17; x -1 attackers' means of 16 fell to -0.07 to -0.32 and of 8 lower. The per-round
  spread is about 0.25, so a mean of 16 has a standard error near 0.06 (of 8, 0.09): an honest pair whose
  level has fallen to 0.05 lies about 3.3 of them above the first line and 3.9 above the second, and over
  thousands of rounds a false ban of an honest groupmate is possible, which costs this peer that groupmate
  for ``BAN_SECONDS``.
  The comparison is with this peer's own part, not with the round's centre, so colluders that own a round
  cannot make theirs look close. When honest cosines average near zero, a gradient times -1 is not banned
  this way (it then does little).
- **unrelated to this peer's own gradient**: a random direction averages a cosine of zero too, but round
  after round its dot product with this peer's part lies within a few standard deviations of zero, where the
  standard deviation is what the sum of the products number by number would have were the signs of one side
  unrelated to the other's (``sqrt(sum((mine_i * its_i)^2))``, swarm/patches/robust.py ``directions``; a
  per-tensor scale, as a random gradient of each tensor's honest norm has, does not change it). An honest
  gradient shares the descent direction, however noisy: in 4-peer demos its dot product lay a median of
  12-14 standard deviations from zero; 5.6 % of the rounds lay within 3 in one of 160 global epochs (958
  judged rounds), 9.6 % in one of 300 (1,794; up to a quarter of a pair's rounds in the last epochs, when
  the model has little left to learn), and never more than 4 rounds in a row. A random gradient of an honest
  norm lay within 3 in 97 of 98 judged rounds of the attack bench. A groupmate whose last
  ``UNRELATED_ROUNDS`` (12) judged rounds all lay within ``UNRELATED_Z`` (3) is banned (slices of at least
  ``UNRELATED_MIN_SIZE`` numbers count; one related round starts the count again).

A groupmate whose last ``WINDOW`` judged scales (at least ``MIN_JUDGED`` of them) average below
``BAN_BELOW`` is banned for ``BAN_SECONDS`` (each later ban of the same peer lasts twice as long as the one
before, up to ``MAX_BAN_SECONDS``): this peer's averagers refuse its requests and do not call it
(swarm/patches/rpc_guard.py), so matchmaking forms groups without it. The ban is this peer's own; the others
judge for themselves.

A peer judges a groupmate only in the rounds they share, and among 5 peers on 2 cores a pair shared 7-16
judged rounds a minute: a groupmate whose directions alone give it away (unrelated rounds, cosines below zero)
was banned within 60 s by one honest peer of three, while the others had judged it 7-9 times of the 12 needed.
So each peer publishes its bans in its metrics record (``banned``), reads the others' (about once a second,
with the swarm's speed), and where another peer bans a groupmate (:func:`note_published_bans`), its own
reducers ban it on half the evidence of unrelated rounds for ``SEEN_BANNED_FOR`` seconds:
``SEEN_UNRELATED_ROUNDS`` (6) in a row. Another peer's word is never a ban by itself, and a peer that this
peer bans has none: an attacker that publishes bans of honest peers only lowers the bar that their honest
rounds must miss (in 4-peer demos, at most 4 unrelated rounds in a row in 2,752 judged rounds). The cosines'
bars stay where they are: an attacker can publish bans of every honest peer at no cost, and the honest lows of
8 cosines in a row (-0.17) leave too little room above the short bar's -0.3 for an easier one.

The table lives in memory shared by the training process and the averager processes it forks (a
fixed number of slots; the oldest unbanned peer makes room for a new one).
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SUSPECT_SCALE = 0.35  # a round in which a sender was scaled by less than this: a clipped round
WINDOW = 5  # the last judged rounds of a groupmate that count
MIN_JUDGED = 4  # judged rounds (since it was first seen or last banned) before a ban
BAN_BELOW = 0.5  # the average scale of its last WINDOW judged rounds that bans it
BAN_SECONDS = 300.0  # the first ban; each later one of the same peer lasts twice as long as the one before
MAX_BAN_SECONDS = 3600.0
STATE_FAR = 1.0  # a state further than this many times this peer's own state's norm from it: far
FAR_STATES = 2  # state rounds in a row in which a groupmate's state lay far from this peer's: a ban
DIR_WINDOW = 16  # a groupmate's last judged directions (cosines with this peer's own gradient) that count
DIR_BELOW = -0.15  # their mean at or below which it is banned
DIR_SHORT_WINDOW = 8  # or its last 8 judged directions (a pair may share few rounds a minute)
DIR_SHORT_BELOW = -0.3  # at or below this mean (a mean of 8 spreads further)
UNRELATED_Z = 3.0  # a dot product within this many standard deviations of zero (signs unrelated): unrelated
UNRELATED_ROUNDS = 12  # judged rounds in a row in which a groupmate's gradient was unrelated to ours: a ban
UNRELATED_MIN_SIZE = 1024  # numbers compared in a round, at least, for it to count either way
# Another peer's ban of a groupmate, read from its metrics record, halves what this peer's own judges need
# to see of that groupmate's directions, for this long after the last read that showed it (seconds)
SEEN_BANNED_FOR = 60.0
SEEN_UNRELATED_ROUNDS = 6  # UNRELATED_ROUNDS where another peer bans it
SLOTS = 256
_PEER_BYTES = 64  # a PeerID in base58 has 46-53 characters


class _Slot(ctypes.Structure):
    _fields_ = [
        ("peer", ctypes.c_char * _PEER_BYTES),
        ("rounds", ctypes.c_int64),  # judged rounds
        ("clipped", ctypes.c_int64),  # of which clipped
        ("recent", ctypes.c_float * WINDOW),  # the scales of its last judged rounds, a ring
        ("filled", ctypes.c_int64),  # judged rounds since it was first seen or last banned
        ("seen", ctypes.c_double),  # when last judged (time.monotonic: one clock for all processes)
        ("banned_until", ctypes.c_double),
        ("bans", ctypes.c_int64),
        ("first_banned", ctypes.c_double),  # when it was first banned (time.time()); 0 if never
        ("ban_scale", ctypes.c_double),  # the average scale that got it banned the last time
        ("far", ctypes.c_int64),  # rounds whose parts it sent lay far from this peer's own (noted_far)
        ("far_states", ctypes.c_int64),  # state rounds in a row in which its state lay far (noted_state)
        ("ban_gap", ctypes.c_double),  # its state's distance (over this peer's norm) when a state ban came
        ("ban_served", ctypes.c_int64),  # 1 if that state was one it served as a donor (served_far)
        ("dirs", ctypes.c_float * DIR_WINDOW),  # its gradients' last judged cosines with this peer's, a ring
        ("dir_filled", ctypes.c_int64),  # judged directions since it was first seen or last banned
        ("ban_dir", ctypes.c_double),  # their mean when a direction ban came; 0 if not one
        ("unrelated", ctypes.c_int64),  # judged rounds in a row in which its gradient was unrelated to ours
        ("ban_unrelated", ctypes.c_int64),  # 1 if the last ban came from that
        ("seen_banned_until", ctypes.c_double),  # another peer's published ban of it counts until then
        ("ban_seen", ctypes.c_int64),  # 1 if it came from the shorter evidence another peer's ban allows
        ("ban_window", ctypes.c_int64),  # the judged directions whose mean got it banned; 0 if not them
    ]


@dataclass(frozen=True)
class Suspect:
    """What this peer holds against one groupmate."""

    peer: str
    rounds: int
    clipped: int
    recent_scale: float  # the average scale of its last WINDOW judged rounds (1 if none since its ban)
    bans: int
    banned_for: float  # seconds left of its ban; 0 if not banned
    first_banned: float  # when this peer first banned it (seconds since the epoch); 0 if never
    ban_scale: float  # the average scale of its last judged rounds when it was last banned; 1 if never
    ban_gap: float = 0.0  # if its last ban came from state rounds: its state's distance from this peer's
    ban_served: bool = False  # if it came from a state it served as a donor (ban_gap: from the swarm's)
    ban_direction: float = 0.0  # if it came from its gradients' directions: their mean cosine with ours
    ban_unrelated: bool = False  # if it came from gradients unrelated to ours (random directions)
    ban_seen: bool = False  # if it came from the shorter evidence that another peer's ban of it allows
    ban_window: int = 0  # if it came from directions: over how many judged rounds their mean was taken
    seen_banned: bool = False  # another peer's published ban of it counts here now


class Suspects:
    """The shared table. Build it before the averager processes fork."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self._slots = ctx.RawArray(_Slot, SLOTS)
        self._lock = ctx.Lock()

    def _find(self, key: bytes, create: bool, now: float, evict: bool = True) -> _Slot | None:
        free = oldest = None
        for slot in self._slots:
            if slot.peer == key:
                return slot
            if not slot.peer:
                free = free if free is not None else slot
            elif slot.banned_until <= now and (oldest is None or slot.seen < oldest.seen):
                oldest = slot
        if not create:
            return None
        slot = free if free is not None else oldest if evict else None
        if slot is None:  # every slot holds a banned peer (or a judged one, and ``evict`` is False)
            return None
        ctypes.memset(ctypes.addressof(slot), 0, ctypes.sizeof(_Slot))
        slot.peer = key
        return slot

    def record(self, peer: str, scale: float, now: float | None = None) -> bool:
        """Count one judged round of ``peer``, in which it was scaled by ``scale`` (0 to 1); True if this
        round got it banned."""
        now = time.monotonic() if now is None else now
        scale = min(1.0, max(0.0, scale)) if math.isfinite(scale) else 0.0

        with self._lock:
            slot = self._find(_key(peer), True, now)
            if slot is None:
                return False
            slot.rounds += 1
            slot.clipped += int(scale < SUSPECT_SCALE)
            slot.recent[slot.filled % WINDOW] = scale
            slot.filled += 1
            slot.seen = now
            if slot.banned_until > now or slot.filled < MIN_JUDGED or _recent_scale(slot) >= BAN_BELOW:
                return False
            _ban(slot, now, _recent_scale(slot), gap=0.0)
            return True

    def noted_direction(
        self, peer: str, cosine: float, z: float = math.inf, size: int = 0, now: float | None = None
    ) -> bool:
        """Count a gradient round in which ``peer``'s parts had ``cosine`` with this peer's own parts over the
        ``size`` numbers of the slice this peer reduced, and a dot product ``z`` standard deviations from what
        it would be were its signs unrelated to this peer's (swarm/patches/robust.py ``directions``); True
        if this round got it banned: its last ``DIR_WINDOW`` cosines average ``DIR_BELOW`` or less, or its
        last ``DIR_SHORT_WINDOW`` ``DIR_SHORT_BELOW`` or less, or its last ``UNRELATED_ROUNDS`` lay within
        ``UNRELATED_Z`` standard deviations of zero."""
        now = time.monotonic() if now is None else now
        cosine = min(1.0, max(-1.0, cosine)) if math.isfinite(cosine) else -1.0
        with self._lock:
            slot = self._find(_key(peer), True, now)
            if slot is None:
                return False
            slot.dirs[slot.dir_filled % DIR_WINDOW] = cosine
            slot.dir_filled += 1
            slot.seen = now
            if size >= UNRELATED_MIN_SIZE:
                unrelated = abs(z) < UNRELATED_Z  # a NaN counts as related
                slot.unrelated = slot.unrelated + 1 if unrelated else 0
            seen = slot.seen_banned_until > now
            # the mean of its last DIR_SHORT_WINDOW, then of its last DIR_WINDOW (each 1 until it has them)
            for window, bar in ((DIR_SHORT_WINDOW, DIR_SHORT_BELOW), (DIR_WINDOW, DIR_BELOW)):
                mean = _direction(slot, window)
                if mean <= bar:
                    break
            pointed = mean <= bar
            rounds = SEEN_UNRELATED_ROUNDS if seen else UNRELATED_ROUNDS
            if slot.banned_until > now or (not pointed and slot.unrelated < rounds):
                return False
            slot.rounds += 1
            slot.clipped += 1
            if pointed:
                _ban(slot, now, 0.0, gap=0.0, direction=mean, window=window)
            else:
                _ban(slot, now, 0.0, gap=0.0, unrelated=True, seen=slot.unrelated < UNRELATED_ROUNDS)
            return True

    def saw_banned(self, peer: str, now: float | None = None) -> bool:
        """Note that another peer publishes a ban of ``peer`` (:func:`note_published_bans`): for
        ``SEEN_BANNED_FOR`` seconds this peer's judges ban it on half the evidence of unrelated rounds
        (``SEEN_UNRELATED_ROUNDS`` in a row). Not a ban, nor a judged round: this peer's own rounds must
        show it. A peer not in the table takes a free slot only: records full of made-up PeerIDs never push
        out what this peer judged (an attacker's own count of unrelated rounds, say). True if it was noted."""
        now = time.monotonic() if now is None else now
        with self._lock:
            slot = self._find(_key(peer), True, now, evict=False)
            if slot is not None:
                slot.seen_banned_until = now + SEEN_BANNED_FOR
            return slot is not None

    def noted_state(self, peer: str, gap: float, now: float | None = None) -> bool:
        """Count a state round in which ``peer``'s state lay ``gap`` times this peer's own state's norm from
        it (swarm/patches/robust.py judges only rounds in which another groupmate's state lay near this
        peer's); True if this round got it banned: ``FAR_STATES`` rounds in a row further than
        ``STATE_FAR``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            slot = self._find(_key(peer), True, now)
            if slot is None:
                return False
            slot.seen = now
            if gap <= STATE_FAR:  # near (a NaN counts as far)
                slot.far_states = 0
                return False
            slot.rounds += 1
            slot.clipped += 1
            slot.far_states += 1
            if slot.banned_until > now or slot.far_states < FAR_STATES:
                return False
            _ban(slot, now, 0.0, gap=gap)
            slot.far_states = 0
            return True

    def served_far(self, peer: str, gap: float, now: float | None = None) -> bool:
        """Count a download from donor ``peer`` that the download check refused (swarm/averaging/donors.py):
        its state's sketch lay ``gap`` times its norm from the sketches that most peers published for its
        epoch (swarm/patches/state_averager.py ``sketch_distance``). One further than ``STATE_FAR`` bans it at
        once (True): donors of random numbers of an honest norm lay 4.9-5.1 away in the attack bench, honest
        DiLoCo donors refused for holding another group's anchors 0.14-0.63 in the volunteers lab, and once
        1.2 (so a DiLoCo peer calls this for no donor: state_averager.py ``bans_bad_donors``). A nearer one is
        not noted at all."""
        if gap <= STATE_FAR:  # a NaN counts as far
            return False
        now = time.monotonic() if now is None else now
        with self._lock:
            slot = self._find(_key(peer), True, now)
            if slot is None:
                return False
            slot.seen = now
            slot.rounds += 1
            slot.clipped += 1
            if slot.banned_until > now:
                return False
            _ban(slot, now, 0.0, gap=gap, served=True)
            return True

    def get(self, peer: str, now: float | None = None) -> Suspect | None:
        """What this peer holds against ``peer``; None if it never judged it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            slot = self._find(_key(peer), False, now)
            return _suspect(slot, now) if slot is not None else None

    def noted_far(self, peer: str, now: float | None = None) -> None:
        """Count a round of three or more senders in which the parts ``peer`` sent this peer's reducer lay far
        from this peer's own part (swarm/patches/robust.py ``FAR_FROM_OWN``). Not a judged round: only the
        round screen, which sees the round's result, can tell an attack (:meth:`far_rounds`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            slot = self._find(_key(peer), True, now)
            if slot is not None:
                slot.far += 1
                slot.seen = now

    def far_rounds(self, peer: str) -> int:
        """Rounds in which ``peer``'s parts lay far from this peer's own (:meth:`noted_far`), so far."""
        with self._lock:
            slot = self._find(_key(peer), False, time.monotonic())
            return int(slot.far) if slot is not None else 0

    def banned_for(self, peer: str, now: float | None = None) -> float:
        """Seconds left of ``peer``'s ban; 0 if it is not banned."""
        found = self.get(peer, now)
        return found.banned_for if found is not None else 0.0

    def suspects(self, now: float | None = None) -> list[Suspect]:
        """Every groupmate with a clipped round, most clipped first."""
        now = time.monotonic() if now is None else now
        with self._lock:
            found = [_suspect(slot, now) for slot in self._slots if slot.peer and slot.clipped]
        return sorted(found, key=lambda s: (-s.clipped, s.peer))

    def clear(self) -> None:
        with self._lock:
            ctypes.memset(ctypes.addressof(self._slots), 0, ctypes.sizeof(self._slots))


def _ban(
    slot: _Slot,
    now: float,
    scale: float,
    gap: float,
    served: bool = False,
    direction: float = 0.0,
    unrelated: bool = False,
    seen: bool = False,
    window: int = 0,
) -> None:
    slot.banned_until = now + min(MAX_BAN_SECONDS, BAN_SECONDS * 2**slot.bans)
    slot.bans += 1
    slot.first_banned = slot.first_banned or time.time()
    slot.ban_scale, slot.ban_gap, slot.ban_served, slot.ban_dir = scale, gap, int(served), direction
    slot.ban_unrelated, slot.ban_seen, slot.ban_window = int(unrelated), int(seen), window
    slot.filled = slot.dir_filled = slot.unrelated = 0  # judged afresh after the ban


def _suspect(slot: _Slot, now: float) -> Suspect:
    return Suspect(
        peer=slot.peer.decode(),
        rounds=slot.rounds,
        clipped=slot.clipped,
        recent_scale=_recent_scale(slot),
        bans=slot.bans,
        banned_for=max(0.0, slot.banned_until - now),
        first_banned=slot.first_banned,
        ban_scale=slot.ban_scale if slot.bans else 1.0,
        ban_gap=slot.ban_gap if slot.bans else 0.0,
        ban_served=bool(slot.ban_served) if slot.bans else False,
        ban_direction=slot.ban_dir if slot.bans else 0.0,
        ban_unrelated=bool(slot.ban_unrelated) if slot.bans else False,
        ban_seen=bool(slot.ban_seen) if slot.bans else False,
        ban_window=slot.ban_window if slot.bans else 0,
        seen_banned=slot.seen_banned_until > now,
    )


def _direction(slot: _Slot, window: int = DIR_WINDOW) -> float:
    """The mean of its last ``window`` (at most DIR_WINDOW) judged cosines; 1 before it has that many."""
    if slot.dir_filled < window:
        return 1.0
    return sum(slot.dirs[(slot.dir_filled - 1 - i) % DIR_WINDOW] for i in range(window)) / window


def _recent_scale(slot: _Slot) -> float:
    count = min(slot.filled, WINDOW)
    return sum(slot.recent[:count]) / count if count else 1.0


def _key(peer: str) -> bytes:
    return peer.encode()[:_PEER_BYTES]


def why_banned(suspect: Suspect) -> str:
    """One line: why this peer keeps ``suspect`` out of its groups."""
    if suspect.ban_served:
        return (
            f"the state it served as a donor shared nothing with the one most peers published for its epoch "
            f"({suspect.ban_gap:.2f} times its norm away) (ban {suspect.bans}, "
            f"{suspect.banned_for:.0f} s left)"
        )
    seen = ", and another peer banned it" if suspect.ban_seen else ""
    if suspect.ban_unrelated:
        rounds = SEEN_UNRELATED_ROUNDS if suspect.ban_seen else UNRELATED_ROUNDS
        return (
            f"its gradient was unrelated to this peer's own round after round ({rounds} judged rounds in a "
            f"row, each as close to orthogonal as a random direction's{seen}) (ban {suspect.bans}, "
            f"{suspect.banned_for:.0f} s left)"
        )
    if suspect.ban_direction:
        return (
            f"its gradient pointed against this peer's own round after round (mean cosine "
            f"{suspect.ban_direction:.2f} over its last {suspect.ban_window} judged rounds) "
            f"(ban {suspect.bans}, {suspect.banned_for:.0f} s left)"
        )
    if suspect.ban_gap:
        return (
            f"its state in state rounds shared nothing with this peer's, which other groupmates held "
            f"({FAR_STATES} rounds in a row; the last {suspect.ban_gap:.2f} times this peer's norm away) "
            f"(ban {suspect.bans}, {suspect.banned_for:.0f} s left)"
        )
    return (
        f"its gradient was far from its groupmates' round after round (scaled to {suspect.ban_scale:.2f} on "
        f"average over its last judged rounds; {suspect.clipped} of {suspect.rounds} rounds clipped) "
        f"(ban {suspect.bans}, {suspect.banned_for:.0f} s left)"
    )


def note_published_bans(table: Suspects, records: Iterable[Any], own: str | None) -> list[str]:
    """Read the bans that other peers publish in their metrics records (``banned``, swarm/net/metrics.py)
    and note each with :meth:`Suspects.saw_banned`; returns the peers so noted. Skipped: this peer's own
    record (``own``, its PeerID), a record without a ``peer_id``, a ban of this peer or of the publisher
    itself, and every ban published by a peer that this peer bans (an attacker's word counts for nothing
    here). Another peer's word is never a ban by itself: an attacker can publish bans of honest peers, and
    then this peer's judges need only half the evidence against them, which honest groupmates did not reach
    (in 4-peer demos no more than 4 unrelated rounds in a row, against 6)."""
    noted = []
    for record in records:
        publisher = record.peer_id
        if not publisher or publisher == own or table.banned_for(publisher) > 0:
            continue
        for peer in record.banned or ():
            if peer not in (own, publisher) and peer not in noted and table.saw_banned(peer):
                noted.append(peer)
    return noted
