"""8-bit decoding (hivemind/compression/quantization.py): a decoder that newer NumPy refuses.

**What hivemind does.** ``Quantization.extract`` (quantization.py:40-47), the decoder of its uniform and
quantile 8-bit codecs, reads the codebook's size with ``int()`` of a one-element array.

**What goes wrong.** NumPy 2.4 and newer refuse that ("only 0-dimensional arrays can be converted to Python
scalars"): every int8 round fails half-way ("received 50% of input tensors") and the peers go on with their
local gradients.

**What this changes.** :func:`install` replaces the decoder with the same one, the element taken explicitly,
and from copies of the buffer's arrays (torch warned "The given NumPy array is not writable" at the first
decode of every process). torch 2.10 and newer warn at every process's first 8-bit encoding that
``torch.quantize_per_tensor``, which hivemind's encoder calls, is deprecated: a two-line UserWarning in the
middle of every int8 peer's output that no user can act on, silenced here (that message only).
"""

from __future__ import annotations

from typing import Any

from swarm.patches._registry import Patch


def _targets() -> list[tuple[Any, str, Any]]:
    import warnings

    import numpy as np
    import torch
    from hivemind.compression import quantization

    warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")

    def extract(self: Any, serialized_tensor: Any) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    return [(quantization.Quantization, "extract", extract)]


PATCH = Patch("compression", _targets)
