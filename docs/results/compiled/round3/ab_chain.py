"""Chained calls against synchronous ones, side by side: four held-out prompts, 64 tokens, a fixed budget, three
interleaved rounds. Prints wall time and the median host work per call while nothing is queued ("host gap").

usage: python docs/results/compiled/round3/ab_chain.py greedy|t07 K   (K: --num-draft-tokens)
"""

import json
import statistics
import sys
import time

import ptp_mlx  # noqa: F401  (the BLAS before mlx)
from ptp_mlx.decode.call import PhaseClock
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.sampler import SamplingSettings

eng = Engine.load()
with open("ptp_mlx/data/heldout_prompts.jsonl") as f:
    prompts = [json.loads(line)["turns"][0] for line in f][:4]
ids_all = [eng.encode(p) for p in prompts]
samp = SamplingSettings() if sys.argv[1] == "greedy" else SamplingSettings(temperature=0.7, top_p=0.95, seed=3)
K = int(sys.argv[2])


def run(ahead: bool):
    toks, t, gaps = [], 0.0, []
    for ids in ids_all:
        clock = PhaseClock()
        opts = DecodeOptions(mode="ptp", max_tokens=64, sampling=samp, num_draft_tokens=K, ahead=ahead, clock=clock)
        t0 = time.perf_counter()
        out = [tk for st in stream_generate(eng.pm, eng.tokenizer, ids, opts) for tk in st.tokens]
        t += time.perf_counter() - t0
        toks.append(out)
        for c in clock.calls[1:]:
            gaps.append(sum(c.get(k, 0.0) for k in ("plan", "build", "read+trim", "update")))
    return toks, t, 1000 * statistics.median(gaps)


res: dict[bool, list[float]] = {}
ref = None
for r in range(3):
    for ahead in (False, True):
        toks, t, gap = run(ahead)
        res.setdefault(ahead, []).append(t)
        print(
            f"round {r} ahead={ahead}: {t:.2f} s, {sum(map(len, toks))} tokens, median host gap {gap:.2f} ms",
            flush=True,
        )
        if ahead:
            assert toks == ref, "chained differs"
        else:
            ref = toks
print({k: min(v) for k, v in res.items()}, "ratio chained/sync (best)", min(res[True]) / min(res[False]))
