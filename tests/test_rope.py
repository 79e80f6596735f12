"""RoPE from one table per call (ptp_mlx/model/rope.py): bit for bit what the module's own ``mx.fast.rope`` gives,
eagerly and compiled, for every variant the table serves (both layouts, partial rotary dimensions, scaled
positions, other bases, Llama 3 frequencies), rows at arbitrary positions; the other variants keep their call."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

from ptp_mlx.model.rope import table_rope, uses_table

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {
    "plain": lambda: nn.RoPE(16, base=10000.0),
    "traditional": lambda: nn.RoPE(16, traditional=True, base=10000.0),
    "partial": lambda: nn.RoPE(8, base=500000.0),
    "partial-traditional": lambda: nn.RoPE(8, traditional=True, base=10000.0),
    "scaled": lambda: nn.RoPE(16, base=1000000.0, scale=0.25),
    "llama3": lambda: Llama3RoPE(16, max_position_embeddings=4096, base=500000.0, scaling_config=LLAMA3),
}


def _rows_own_rope(rope, x, positions):
    """The reference: the module itself, each row a batch entry at its own position."""
    return mx.swapaxes(rope(mx.swapaxes(x, 0, 2), offset=positions), 0, 2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_table_rope_is_bit_exact(name, dtype):
    rope = ROPES[name]()
    assert uses_table(rope) == (mx.default_device() == mx.cpu)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 3, 7, 16)).astype(np.float32)).astype(dtype)
    positions = mx.array([5, 6, 7, 300, 301, 4095, 0], dtype=mx.int32)
    want = _rows_own_rope(rope, x, positions)
    got = table_rope(rope, x, positions, {})
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want).item()
    compiled = mx.compile(lambda a, p: table_rope(rope, a, p, {}))
    assert mx.array_equal(compiled(x, positions), want).item()
    # The rotation moved something (a table of ones would pass the equality on position 0 alone).
    assert not mx.array_equal(got, x).item()


def test_one_table_serves_every_layer():
    a, b = nn.RoPE(16, base=10000.0), nn.RoPE(16, base=10000.0)
    la, lb = (Llama3RoPE(16, 4096, base=500000.0, scaling_config=LLAMA3) for _ in range(2))
    x = mx.ones((1, 2, 3, 16))
    pos = mx.array([1, 2, 3], dtype=mx.int32)
    tables: dict = {}
    for r in (a, b, la, lb):
        table_rope(r, x, pos, tables)
    assert len(tables) == 2  # equal modules share; a different base or frequencies does not
    table_rope(nn.RoPE(16, base=10.0), x, pos, tables)
    assert len(tables) == 3


def test_prescaling_variants_keep_their_own_call():
    rope = SuScaledRoPE(
        16,
        base=10000.0,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        short_factor=[1.0] * 8,
        long_factor=[2.0] * 8,
    )
    assert not uses_table(rope)
