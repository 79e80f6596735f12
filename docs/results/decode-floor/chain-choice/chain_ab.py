"""The whole decoder with its calls built ahead or not: one engine answers each held-out prompt (greedy, 128 tokens)
once per way, the order rotating prompt by prompt, and the decode tok/s of each way over all answers (prefill
aside). Every answer is checked to be the same tokens whichever way it ran.

    python docs/results/decode-floor/chain-choice/chain_ab.py [WAYS] [ROUNDS]

WAYS, comma-separated: ``learnt`` (the default, ``chain=None``), ``never`` (``chain=False``), ``always``
(``chain=True``), ``one-build`` (always, one build a call), ``after-lookup`` (always, but only after lookup calls),
``no-start`` (always, but nothing built on a burst's last step). Default: learnt,never,always.
"""

import json
import sys

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx import generate
from ptp_mlx.decode import pipeline
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine

WAY = ["learnt"]
ptp_calls, chain, start = generate.ptp_calls, pipeline.CallQueue.chain, pipeline.CallQueue.start_after_burst


def calls(*a, **k):
    k["chain"] = None if WAY[0] == "learnt" else WAY[0] != "never"
    return ptp_calls(*a, **k)


def chain_some(self):
    if WAY[0] == "after-lookup" and self.running is not None and self.running.plan.source != "lookup":
        return
    chain(self)


def start_some(self, token, i):
    if WAY[0] != "no-start":
        start(self, token, i)


generate.ptp_calls, pipeline.CallQueue.chain, pipeline.CallQueue.start_after_burst = calls, chain_some, start_some
ways = (sys.argv[1] if len(sys.argv) > 1 else "learnt,never,always").split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
eng = Engine.load()
prompts = [json.loads(line)["turns"][0] for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
total = {w: [0, 0.0] for w in ways}
first: dict[int, list[int]] = {}
for r in range(rounds):
    for k, prompt in enumerate(prompts):
        at = (k + r) % len(ways)
        for w in ways[at:] + ways[:at]:
            WAY[0] = w
            pipeline.MAX_KINDS = 1 if w == "one-build" else 2
            tokens: list[int] = []
            for st in eng.generate(prompt, max_tokens=128):
                tokens += st.tokens
            assert first.setdefault(k, tokens) == tokens, f"prompt {k} answered differently with {w}"
            total[w][0] += st.generated
            total[w][1] += st.elapsed
print(choice_for(eng.pm).describe())
for w in ways:
    print(f"{w:12s} {total[w][0] / total[w][1]:.2f} tok/s ({total[w][0]} tokens)")
