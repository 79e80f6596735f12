"""New shapes compiled at their first call (``CompileBank.compile_after`` 1, the default since 2026-12-07 where a layer
is one primitive) or run eagerly first and traced at their second (2, before): two engines on the same probed prior,
each learning across its answers, answer every held-out prompt in turn (the order alternating); decode tok/s of each
over all answers (prefill aside), every pair of answers the same tokens, and how many calls of each ran a shape
uncompiled (eager or tracing).

    python docs/results/decode-floor/2026-12-07/compile_ab.py [ROUNDS] [TEMP]
"""

import json
import sys

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx.decode.fixed import bank_for
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
engines = {1: Engine.load(), 2: Engine.load()}
for after, eng in engines.items():
    eng.budget.curve.path = None  # (neither writes the shared file back mid-run)
    bank_for(eng.pm).compile_after = after
prompts = [json.loads(line)["turns"][0] for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
total = {w: [0, 0.0] for w in engines}
for r in range(rounds):
    for k, prompt in enumerate(prompts):
        s = SamplingSettings(temp, 0, 0.95 if temp else 1.0, seed=k)
        answers = {}
        for way in (1, 2) if (k + r) % 2 == 0 else (2, 1):
            tokens = []
            for st in engines[way].generate(prompt, sampling=s, max_tokens=128):
                tokens += st.tokens
            answers[way] = tokens
            total[way][0] += st.generated
            total[way][1] += st.elapsed
        assert answers[1] == answers[2], f"prompt {k}: the answers differ"
for way, (n, sec) in total.items():
    bank = bank_for(engines[way].pm)
    print(f"compile_after {way}: {n} tokens, {sec:.2f} s, {n / sec:.2f} tok/s, {bank.cold} calls uncompiled")
print(f"first call / second call: {(total[1][0] / total[1][1]) / (total[2][0] / total[2][1]):.3f}")
