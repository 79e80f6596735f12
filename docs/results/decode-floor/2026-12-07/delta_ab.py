"""The whole decoder with the LoRA delta of ptp-gated-linear split between ptp-sgemm's two threads (the default)
or computed on one (``PTP_MLX_DELTA_THREADS=1``, read per call): one engine answers each held-out prompt once per
way, the order alternating prompt by prompt; decode tok/s of each way over all answers (prefill aside), and every
answer checked to be the same tokens either way.

    python docs/results/decode-floor/2026-12-07/delta_ab.py [ROUNDS] [TEMP]

TEMP > 0 samples with top-p 0.95.
"""

import json
import os
import sys

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
eng = Engine.load()
prompts = [json.loads(line)["turns"][0] for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
total = {w: [0, 0.0, 0] for w in ("2", "1")}
first: dict[int, list[int]] = {}
for r in range(rounds):
    for k, prompt in enumerate(prompts):
        for way in ("2", "1") if (k + r) % 2 == 0 else ("1", "2"):
            os.environ["PTP_MLX_DELTA_THREADS"] = way
            tokens: list[int] = []
            calls = 0
            for st in eng.generate(
                prompt, sampling=SamplingSettings(temp, 0, 0.95 if temp else 1.0, seed=k), max_tokens=128
            ):
                tokens += st.tokens
                calls += 1
            assert first.setdefault(k, tokens) == tokens, f"prompt {k} answered differently ({way} threads)"
            total[way][0] += st.generated
            total[way][1] += st.elapsed
            total[way][2] += calls
for way, (n, s, c) in total.items():
    print(f"delta on {way} thread(s), PTP T {temp:g}: {n} tokens in {c} calls, {s:.2f} s, {n / s:.2f} tok/s")
print(f"two / one: {(total['2'][0] / total['2'][1]) / (total['1'][0] / total['1'][1]):.3f}")
