"""Prefill A/B, interleaved in one process (4 rounds, the first dropped): each prompt length prefilled with every
pair of ptp-sgemm's row limit (``ptp_sgemm_set_max_m``: longer products go to MKL on both threads) and prefill chunk
(``decode/ar.py: PREFILL_CHUNK``), into our K/V state (``pm.make_cache()``: what ``ptp-generate`` prefills, its
attention one CPU primitive a layer) and into mlx-lm's cache (what mlx-lm's own generation prefills).

Usage: ``python docs/results/kernel/max-m/prefill_ab.py LENGTHS CAPS CHUNKS``, e.g. ``100,300,512 64,512 512`` or
``512,1024 256 64,128,256,512``."""

import ctypes
import sys
import time

import ptp_mlx.decode.ar as ar  # (ptp_mlx before MLX: the kernel binds first)
from ptp_mlx import blas
from ptp_mlx.engine import Engine


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    lengths, caps, chunks = ([int(a) for a in arg.split(",")] for arg in sys.argv[1:4])
    lib = blas.kernel()
    lib.ptp_sgemm_set_max_m.argtypes = [ctypes.c_int]
    default_cap, default_chunk = lib.ptp_sgemm_max_m(), ar.PREFILL_CHUNK
    pm = Engine.load().pm
    base = pm.base
    caches = {"ours": pm.make_cache, "mlx-lm": lambda: make_prompt_cache(base)}
    times: dict[tuple, list[float]] = {}
    for n in lengths:
        tokens = [(7 * i + 3) % 4000 + 100 for i in range(n)]
        for rnd in range(4):
            for cap in caps:
                for chunk in chunks:
                    for kind, make in caches.items():
                        lib.ptp_sgemm_set_max_m(cap)
                        ar.PREFILL_CHUNK = chunk
                        cache = make()
                        t0 = time.perf_counter()
                        ar.prefill(base, tokens, cache)  # (evaluates each chunk's K/V)
                        if rnd:
                            times.setdefault((kind, n, cap, chunk), []).append(time.perf_counter() - t0)
    lib.ptp_sgemm_set_max_m(default_cap)
    ar.PREFILL_CHUNK = default_chunk
    for (kind, n, cap, chunk), t in sorted(times.items()):
        med = sorted(t)[len(t) // 2]
        print(
            f"{kind:6s} cache, prompt {n:4d}, kernel up to {cap:3d} rows, chunk {chunk:3d}: "
            f"best {n / min(t):6.1f} tok/s, median {n / med:6.1f}"
        )


if __name__ == "__main__":
    main()
