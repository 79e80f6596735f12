"""The learnt cost curve corrected on each call's cost beyond one step (the default) or on its whole cost (the
reference, the rebuild before 2026-12-07): two engines on the same probed prior, each learning across its answers
as the chat and the server do, answer every held-out prompt in turn (the order alternating), plus our plain decoding
on the first engine; decode tok/s of each over all answers (prefill aside), every PTP answer checked against plain
decoding's, the drafts each accepted by source, and the curve each ends with.

    python docs/results/decode-floor/2026-12-07/excess_ab.py [ROUNDS] [TEMP]
"""

import collections
import json
import math
import sys

import numpy as np

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx.drafting import learn
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings


def whole_cost_rebuild(self) -> None:
    """The rebuild before 2026-12-07: unmeasured widths take the measured widths' whole-cost ratio."""
    step = self._estimate(1)
    seen = sorted(b for b in set(self.samples) | set(self.ceiling) if b > 1)
    table = self._prior_table.copy()
    if step is not None and seen:
        corr = [self._estimate(b) - self._prior_log(b) for b in seen]
        widths = np.arange(2, learn.MAX_ROWS + 1)
        log_corr = np.interp(widths, seen, corr)
        prior_log = self._step_prior + np.log(self._prior_table[2:])
        table[2:] = np.exp(prior_log + log_corr - step)
    table[1] = 1.0
    self._table_ = np.maximum.accumulate(np.maximum(table, 1.0))
    self._step = None if step is None else math.exp(step)
    self._stale = False


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
engines = {"excess": Engine.load(), "whole": Engine.load()}
curve = engines["whole"].budget.curve
curve._rebuild = whole_cost_rebuild.__get__(curve)
curve.path = None  # (neither writes the shared file back mid-run: each keeps its own learning)
engines["excess"].budget.curve.path = None
assert all(b.curve is curve for b in [engines["whole"].budget, *engines["whole"].mode_budgets.values()])
prompts = [json.loads(line)["turns"][0] for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
total = {w: [0, 0.0, 0] for w in ("excess", "whole", "ar")}
sources = {w: collections.Counter() for w in ("excess", "whole")}
for r in range(rounds):
    for k, prompt in enumerate(prompts):
        s = SamplingSettings(temp, 0, 0.95 if temp else 1.0, seed=k)
        ways = ["excess", "whole", "ar"] if (k + r) % 2 == 0 else ["ar", "whole", "excess"]
        answers = {}
        for way in ways:
            eng = engines["excess" if way == "ar" else way]
            tokens, calls = [], 0
            for st in eng.generate(prompt, mode="ar" if way == "ar" else "ptp", sampling=s, max_tokens=128):
                tokens += st.tokens
                calls += 1
                if way != "ar" and st.source is not None:
                    sources[way][st.source] += st.accepted
            answers[way] = tokens
            total[way][0] += st.generated
            total[way][1] += st.elapsed
            total[way][2] += calls
        assert answers["excess"] == answers["ar"] == answers["whole"], f"prompt {k}: an answer differs"
for way, (n, sec, c) in total.items():
    print(f"{way:6s} T {temp:g}: {n} tokens in {c} calls, {sec:.2f} s, {n / sec:.2f} tok/s")
pace = {w: total[w][0] / total[w][1] for w in total}
print(
    f"excess / whole: {pace['excess'] / pace['whole']:.3f}; excess / ar: {pace['excess'] / pace['ar']:.3f}; "
    f"whole / ar: {pace['whole'] / pace['ar']:.3f}"
)
for way in ("excess", "whole"):
    c = engines[way].budget.curve
    print(f"{way}: accepted drafts {dict(sources[way])}; curve 2-8 rows:", [round(c(w), 2) for w in range(2, 9)])
