"""``--compression none|fp16|int8|powersgd:<rank>``: how tensors travel between peers.

One spec chooses the wire format of two exchanges: the gradient all-reduce (DiLoCo's pseudo-gradients in
``--averaging diloco``) and the parameter averaging rounds. The state download of a newcomer (and of a peer
that fell behind) always travels as float32: a peer that downloaded parameters rounded to float16 held a
state 1e-7 to 1e-6 of its norm away from its donor's for good, so its groups were never found in agreement
(docs/hivemind-patches.md item 16) and ran every state round.

* ``none``: float32 everywhere.
* ``fp16``: gradients and parameters as float16 (2 bytes per number).
* ``int8``: gradients as 8-bit (hivemind's ``Uniform8BitQuantization``: 256 buckets over +-3 sigma, each
  decoded to its bucket's mean; tensors under ``INT8_MIN_SIZE``, 4096 numbers, go as float16),
  parameters as float16. Parameters in 8 bits would lose the weights themselves, not a step's worth of them.
* ``powersgd:<rank>``: gradients through hivemind's ``PowerSGDGradientAverager`` (each matrix sent as two
  rank-r factors, with error feedback; vectors and matrices that do not shrink by half go whole), parameters
  as float16.

Optimizer statistics (AdamW's moments, the outer momentum) always travel as float32: AdamW's second moment
is often below float16's smallest number (6e-8), would arrive as 0, and the next update would divide by eps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

MODES = ("none", "fp16", "int8", "powersgd:<rank>")
# smaller tensors go as fp16: an 8-bit tensor carries a 256-entry float32 codebook (1 KiB), so at 4096 numbers
# it costs 1.25 bytes per number and below 1024 no less than fp16 (hivemind's albert example uses 2**16 + 1,
# for a model whose tensors are all far larger)
INT8_MIN_SIZE = 2**12


class CompressionError(ValueError):
    """A --compression value that is not one of MODES."""


@dataclass(frozen=True)
class Compression:
    spec: str
    mode: str  # none | fp16 | int8 | powersgd
    rank: int | None = None

    def grad_compression(self) -> Any:
        from hivemind.compression import (
            Float16Compression,
            NoCompression,
            SizeAdaptiveCompression,
            Uniform8BitQuantization,
        )

        if self.mode == "fp16":
            return Float16Compression()
        if (
            self.mode == "int8"
        ):  # hivemind's 8-bit decoder needs swarm/patches/compression.py with NumPy >= 2.4
            return SizeAdaptiveCompression(
                threshold=INT8_MIN_SIZE, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
            )
        return NoCompression()  # none; powersgd compresses by factorising, its factors go as float32

    def state_compression(self) -> Any:
        """Parameter averaging rounds: parameters compressed, optimizer state not. Each peer adds the rounded
        difference between the average and its part as sent (docs/hivemind-patches.md item 36), so the
        groupmates differ by the rounding of that difference, not of the weights."""
        from hivemind.compression import Float16Compression, NoCompression, RoleAdaptiveCompression

        if self.mode == "none":
            return NoCompression()
        return RoleAdaptiveCompression(parameter=Float16Compression(), default=NoCompression())

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Arguments of ``hivemind.Optimizer`` (the gradient averager's factory aside)."""
        from hivemind.compression import NoCompression

        return dict(
            grad_compression=self.grad_compression(),
            state_averaging_compression=self.state_compression(),
            load_state_compression=NoCompression(),  # a download is the donor's state, to the last bit
        )

    def grad_averager_factory(self, base: Any = None, **kwargs: Any) -> Any:
        """hivemind's gradient averager for this mode (PowerSGD's own for ``powersgd``), or ``base``."""
        if self.mode == "powersgd":
            from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

            return partial(PowerSGDGradientAverager, averager_rank=self.rank, **kwargs)
        if base is None:
            from hivemind.optim.grad_averager import GradientAverager as base
        return partial(base, **kwargs)


def parse_compression(spec: str) -> Compression:
    text = str(spec).strip().lower()
    if text in ("none", "fp16", "int8"):
        return Compression(text, text)
    if text.startswith("powersgd:"):
        rank = text.split(":", 1)[1]
        if rank.isdigit() and int(rank) >= 1:
            return Compression(text, "powersgd", int(rank))
    raise CompressionError(
        f"compression must be one of {', '.join(MODES)} (a rank is an integer >= 1, e.g. powersgd:4), "
        f"got {spec!r}"
    )
