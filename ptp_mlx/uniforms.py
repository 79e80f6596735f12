"""The uniforms that drive sampling: ``u[i]`` decides generated token ``i`` (docs/method.md, section 1), the same
number for plain decoding and for PTP's drafts and verification, which is what makes PTP lossless."""

from __future__ import annotations

import numpy as np


class UniformStream:
    """Seeded, index-addressable stream of float32 uniforms in [0, 1): ``u[i]`` drives generated token i."""

    CHUNK = 4096

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._buf = np.zeros(0, dtype=np.float32)

    def take(self, start: int, n: int) -> np.ndarray:
        while self._buf.size < start + n:
            # Fixed chunk size keeps the stream identical however it is read.
            self._buf = np.concatenate([self._buf, self._rng.random(self.CHUNK, dtype=np.float32)])
        return self._buf[start : start + n]

    def __getitem__(self, i: int) -> float:
        return float(self.take(i, 1)[0])
