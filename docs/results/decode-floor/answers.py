"""Per answer, AR then PTP on each held-out prompt in one process (after one warm-up answer each): decode seconds,
and PTP's time split into bursts, cold calls (a shape's first uses) and warm calls.

Usage: ``python docs/results/decode-floor/answers.py 0.7`` (temperature; 0 for greedy), from the repository root."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.drafting.budget import Budget
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

log = []
record = Budget.record


def logged(self, rows, tokens, seconds, cold=False, *rest):
    log.append((rows, tokens, seconds, cold))
    return record(self, rows, tokens, seconds, cold, *rest)


Budget.record = logged
temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.7
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]


def run(p, mode):
    return list(eng.generate([{"role": "user", "content": p["turns"][0]}], max_tokens=128, mode=mode, sampling=S))


run(prompts[0], "ar")  # warm-up, as the bench
run(prompts[0], "ptp")
tot = {"ar": 0.0, "ptp": 0.0}
lost, lost_n, warm_n = 0.0, 0, 0
for p in prompts:
    a = run(p, "ar")
    del log[:]
    b = run(p, "ptp")
    ta, tb = sum(s.step_time for s in a), sum(s.step_time for s in b)
    step = ta / max(1, len(a))
    tot["ar"] += ta
    tot["ptp"] += tb
    cold = [e for e in log if e[0] > 1 and e[3]]
    warm = [e for e in log if e[0] > 1 and not e[3]]
    burst = sum(s.step_time for s in b if s.rows == 1)
    losing = [e for e in warm if e[1] * step < e[2]]  # fewer tokens than plain steps would give in its time
    lost += sum(e[2] - e[1] * step for e in losing)
    lost_n += len(losing)
    warm_n += len(warm)
    same = [t for s in a for t in s.tokens] == [t for s in b for t in s.tokens]
    print(
        f"{p['category'][:12]:12s} ar {ta:6.2f}s ptp {tb:6.2f}s ({ta / tb:4.2f}x) steps {len(a)} calls {len(b)} "
        f"cold {len(cold)} {sum(e[2] for e in cold) / step:5.1f}st warm {len(warm)} "
        f"{sum(e[2] for e in warm) / step:5.1f}st/{sum(e[1] for e in warm)}tok burst {burst / step:5.1f}st "
        f"{'same' if same else 'DIFF'}",
        flush=True,
    )
print(f"total ar {tot['ar']:.2f}s ptp {tot['ptp']:.2f}s ratio {tot['ar'] / tot['ptp']:.3f}")
print(f"warm PTP calls {warm_n}, of them losing {lost_n}: {lost:.2f}s lost")
