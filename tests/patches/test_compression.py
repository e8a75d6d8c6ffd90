"""What swarm/patches/compression.py changes: hivemind's 8-bit decoder, which NumPy 2.4 and newer refuse. Each
scenario runs on plain hivemind, where it shows the failure (with such a NumPy), and with the patch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hivemind.compression import Uniform8BitQuantization, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from tests.patches.common import MATCHMAKING, PLAIN_OR_PATCHED, _vector_averagers, hivemind_as

# NumPy 2.4 and newer refuse int() of an array with a dimension, even of one element
NUMPY_REFUSES = tuple(int(part) for part in np.__version__.split(".")[:2]) >= (2, 4)


def _decoded_by_hand(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """The wire format of hivemind's 8-bit codecs (compression/quantization.py:31-38): the codebook's size as
    one int64, the float32 codebook, one uint8 index per number; each number decodes to its codebook entry."""
    buffer = serialized.buffer
    size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook = torch.as_tensor(np.frombuffer(buffer, offset=8, count=size, dtype=np.float32).copy())
    indices = np.frombuffer(buffer, offset=8 + 4 * size, dtype=np.uint8)
    return codebook[torch.from_numpy(indices.astype(np.int64))].reshape(tuple(serialized.size))


@pytest.mark.parametrize("codec", ["UNIFORM_8BIT", "QUANTILE_8BIT"])
@PLAIN_OR_PATCHED
def test_8_bit_tensors_decode_with_the_installed_numpy(patched, codec):
    """hivemind's ``Quantization.extract`` (compression/quantization.py:40-41), the decoder of its uniform and
    quantile 8-bit codecs (``--compression int8``), reads the codebook's size with ``int()`` of a one-element
    array. With NumPy 2.4 and newer, plain hivemind refuses every 8-bit tensor it receives with TypeError
    ("only 0-dimensional arrays can be converted to Python scalars"), so every int8 round fails half-way; with
    an older NumPy it decodes. The patched decoder takes the element explicitly: every number decodes to its
    codebook entry, exactly."""
    tensor = torch.randn(64, 33, generator=torch.Generator().manual_seed(0))
    with hivemind_as(patched, "compression"):
        serialized = serialize_torch_tensor(tensor, runtime_pb2.CompressionType.Value(codec))
        if NUMPY_REFUSES and not patched:
            with pytest.raises(
                TypeError, match="only 0-dimensional arrays can be converted to Python scalars"
            ):
                deserialize_torch_tensor(serialized)
            return
        decoded = deserialize_torch_tensor(serialized)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, _decoded_by_hand(serialized))
    assert len(torch.unique(decoded)) <= 256  # 8 bits: the codebook's entries, nothing else
    assert (decoded - tensor).norm() / tensor.norm() < 0.05  # 256 buckets: 2.2 % (uniform), 2.8 % (quantile)


@pytest.mark.skipif(not NUMPY_REFUSES, reason="hivemind's own decoder works with this NumPy")
@PLAIN_OR_PATCHED
def test_an_8_bit_round_averages(nodes, patched):
    """What the refused decoder does to a round (``--compression int8``): two averagers with hivemind's
    uniform 8-bit codec average one tensor each. With plain hivemind the reducer cannot decode the part it
    receives, so it averages its own part alone and sends nothing back ("Reducer: received 50.0% of input
    tensors", "Averaging: received 0.0% results", averaging/partition.py:174 and 274), yet the step reports
    both peers: every tensor stays as it was. With the patch both hold the mean, to 8-bit precision."""
    tensors = [torch.randn(20_000, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    mean = (tensors[0] + tensors[1]) / 2
    with hivemind_as(patched):
        # the shared nodes keep the other variant's records: one prefix each
        pair = _vector_averagers(
            nodes(2), tensors, f"pytest-int8-{patched}", compression=Uniform8BitQuantization()
        )
    try:
        controls = [a.step(wait=False, timeout=MATCHMAKING + 10) for a in pair]
        assert all(len(c.result(timeout=MATCHMAKING - 5)) == 2 for c in controls)
        for averager, tensor in zip(pair, tensors, strict=True):
            with averager.get_tensors() as (got,):
                if patched:
                    assert (got - mean).norm() / mean.norm() < 0.05  # 1.2 to 2.1 %, measured
                else:
                    assert torch.equal(got, tensor)
    finally:
        for averager in pair:
            averager.shutdown()
