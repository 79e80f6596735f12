"""The answer's first PTP call built while the prompt's last prefill chunk computes, or after the whole prefill was
waited for (as before 2026-12-06, seventh session), A/B in one process with our AR beside: every held-out prompt
answered by each in turn (order rotated per prompt), ``rounds`` times, greedy, 128 tokens. Reports the whole answer's
wall time (prefill included: what the change moves) and the decoding steps' time, and checks every answer against
AR's.

Usage: ``python docs/results/decode-floor/prefill_ab.py [rounds]`` from the repository root."""

import json
import sys
import time

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
import ptp_mlx.generate as gen
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
eng = Engine.load()
s = SamplingSettings(temperature=0.0, seed=0)
prefill = gen.prefill
waited = [False]


def maybe_waited(model, tokens, cache, wait=True):
    return prefill(model, tokens, cache, wait=wait or waited[0])


gen.prefill = maybe_waited
variants = {"ar": ("ar", False), "ptp waited": ("ptp", True), "ptp beside": ("ptp", False)}
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def answer(p, mode):
    messages = [{"role": "user", "content": p["turns"][0]}]
    t0 = time.perf_counter()
    steps = list(eng.generate(messages, mode=mode, sampling=s, max_tokens=128))
    return time.perf_counter() - t0, sum(st.step_time for st in steps), [t for st in steps for t in st.tokens]


for mode in ("ar", "ptp"):
    answer(prompts[0], mode)
wall = dict.fromkeys(variants, 0.0)
steps = dict.fromkeys(variants, 0.0)
order = list(variants)
for r in range(rounds):
    for p in prompts:
        ref = None
        for name in order:
            mode, waited[0] = variants[name]
            w, st, toks = answer(p, mode)
            ref = ref or toks
            assert toks == ref, f"{name} on {p['question_id']}: the answer differs from AR's"
            wall[name] += w
            steps[name] += st
        order = order[1:] + order[:1]
    print(f"round {r + 1}: " + "  ".join(f"{k} wall {wall[k]:.2f} s steps {steps[k]:.2f} s" for k in variants))
    print("  PTP against AR (wall): " + "  ".join(f"{k} {wall['ar'] / wall[k]:.3f}x" for k in variants if k != "ar"))
    gain = wall["ptp waited"] / wall["ptp beside"], steps["ptp waited"] / steps["ptp beside"]
    print(f"  beside against waited: wall {gain[0]:.4f}x, steps {gain[1]:.4f}x", flush=True)
print("lossless: every answer equals AR's")
