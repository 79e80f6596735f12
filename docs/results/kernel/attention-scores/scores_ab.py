"""AR and PTP answers to two long prompts (about 1100 and 1450 tokens: docs/method.md's sections 1 and 10 with a
question), in one process, attention's scores by ptp-sgemm's kernel (PTP_MLX_ATTENTION_SCORES=1, read per call) or
by attention's own loop (0), interleaved over three rounds: tokens per second after each answer's first token.

    python docs/results/kernel/attention-scores/scores_ab.py
"""

import json
import os
import time
from pathlib import Path

import ptp_mlx  # noqa: F401  (before mlx: the BLAS and the kernel)
from ptp_mlx.engine import Engine

eng = Engine.load()
prompts = [json.loads(line)["turns"][0] for line in open(Path(__file__).with_name("long.jsonl"))]
print("prompt tokens:", [len(eng.encode(p)) for p in prompts])


def answer(p: str, mode: str) -> tuple[int, float]:
    t0, n = None, 0
    for st in eng.generate(p, mode=mode, max_tokens=96):
        if t0 is None:
            t0 = time.perf_counter()
        n += len(st.tokens)
    return n, time.perf_counter() - t0


for p in prompts:  # warm-up: every shape compiled
    answer(p, "ptp")
    answer(p, "ar")
res: dict[tuple[str, str], list[float]] = {}
for _ in range(3):
    for sc in ("0", "1"):
        os.environ["PTP_MLX_ATTENTION_SCORES"] = sc
        for mode in ("ar", "ptp"):
            n = t = 0
            for p in prompts:
                a, b = answer(p, mode)
                n, t = n + a, t + b
            res.setdefault((sc, mode), []).append(n / t)
for (sc, mode), v in sorted(res.items()):
    print("scores", sc, mode, " ".join(f"{x:.1f}" for x in v), "tok/s (after the first token), best", f"{max(v):.1f}")
