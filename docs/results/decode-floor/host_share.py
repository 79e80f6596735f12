"""How much of a PTP answer the host's on-path work of its PTP calls is, on the held-out prompts: every call's
phases (``PhaseClock``, as ``ptp-bench --profile`` splits them) summed over all answers, against the answers' wall
time and their PTP calls' time (the rest is autoregressive bursts).

Usage: ``python docs/results/decode-floor/host_share.py [temperature]`` from the repository root."""

import json
import sys
import time
from collections import Counter

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.decode.call import PhaseClock
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
s = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def answer(p, clock):
    ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": p["turns"][0]}])
    opts = DecodeOptions(
        mode="ptp", max_tokens=128, sampling=s, drafting=DraftingConfig(budget=eng.budget_for(s)), clock=clock
    )
    t0 = time.perf_counter()
    steps = list(stream_generate(eng.pm, eng.tokenizer, ids, opts))
    return time.perf_counter() - t0, steps


answer(prompts[0], PhaseClock())  # warm-up
phases, wall, n_calls, n_steps, ptp_s = Counter(), 0.0, 0, 0, 0.0
for p in prompts:
    clock = PhaseClock()
    w, steps = answer(p, clock)
    calls = [c for c in clock.calls if "rows" in c]  # (PTP calls; a burst's turn leaves no "rows")
    wall, n_calls, n_steps = wall + w, n_calls + len(calls), n_steps + len(steps)
    ptp_s += sum(st.step_time for st in steps if st.rows > 1)
    for c in calls:
        phases.update({k: v for k, v in c.items() if isinstance(v, float) and k != "rows"})
print(f"wall {wall:.2f} s; {n_steps} steps, {n_calls} of them PTP calls taking {ptp_s:.2f} s")
for k, v in phases.most_common():
    print(f"  {k:10s} {v:.3f} s  {1e3 * v / n_calls:.3f} ms per PTP call")
on = sum(phases[k] for k in ("plan", "build", "read+trim", "update"))
print(
    f"host on the path: {on:.3f} s = {100 * on / wall:.1f}% of the wall time, {100 * on / ptp_s:.1f}% of the PTP calls'"
)
