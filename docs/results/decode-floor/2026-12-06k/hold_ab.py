"""The whole decoder with ptp-block's weights held by the primitive (the default) or taken as graph inputs (the
reference, ``block_hold(False)``): one engine answers each held-out prompt once per way, the order alternating
prompt by prompt, each way with its own compiled calls; decode tok/s of each way over all answers (prefill aside),
and every answer checked to be the same tokens either way.

    python docs/results/decode-floor/2026-12-06k/hold_ab.py [ROUNDS] [TEMP] [MODE]

MODE: ``ptp`` (the default) or ``ar``. TEMP > 0 samples with top-p 0.95.
"""

import json
import sys

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx.engine import Engine
from ptp_mlx.kernels import extension
from ptp_mlx.sampler import SamplingSettings

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
mode = sys.argv[3] if len(sys.argv) > 3 else "ptp"
eng = Engine.load()
ext = extension.module()
prompts = [json.loads(line)["turns"][0] for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
banks: dict[bool, dict] = {True: {}, False: {}}
total = {w: [0, 0.0] for w in (True, False)}
first: dict[int, list[int]] = {}
for r in range(rounds):
    for k, prompt in enumerate(prompts):
        for hold in (True, False) if (k + r) % 2 == 0 else (False, True):
            ext.block_hold(hold)
            eng.pm.__dict__["_banks"] = banks[hold]
            tokens: list[int] = []
            for st in eng.generate(
                prompt, mode=mode, sampling=SamplingSettings(temp, 0, 0.95 if temp else 1.0, seed=k), max_tokens=128
            ):
                tokens += st.tokens
            assert first.setdefault(k, tokens) == tokens, f"prompt {k} answered differently (held: {hold})"
            total[hold][0] += st.generated
            total[hold][1] += st.elapsed
ext.block_hold(True)
for hold, (n, s) in total.items():
    print(f"{'held  ' if hold else 'inputs'} {mode} T {temp:g}: {n} tokens in {s:.2f} s, {n / s:.2f} tok/s")
print(f"held / inputs: {(total[True][0] / total[True][1]) / (total[False][0] / total[False][1]):.3f}")
