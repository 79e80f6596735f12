"""Each default-drafter PTP call's host phases on the critical path (ms), chained or synchronous, on the held-out
prompts of the given categories (the second of two passes, so shapes are compiled).

Usage: ``python docs/results/decode-floor/phases.py summarization,rag`` from the repository root."""

import json
import sys

import ptp_mlx  # noqa: F401  (before mlx.core)
from ptp_mlx.decode.call import PhaseClock
from ptp_mlx.drafting.policy import DraftingConfig
from ptp_mlx.engine import Engine
from ptp_mlx.generate import DecodeOptions, stream_generate
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings

eng = Engine.load()
prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
cats = sys.argv[1].split(",") if len(sys.argv) > 1 else ["summarization"]
s = SamplingSettings()
for rep in range(2):
    for p in (q for q in prompts if q["category"] in cats):
        ids = encode_prompt(eng.tokenizer, p["turns"][0])
        clock = PhaseClock()
        drafting = DraftingConfig(budget=eng.budget_for(s))
        opts = DecodeOptions(mode="ptp", max_tokens=128, sampling=s, drafting=drafting, clock=clock)
        list(stream_generate(eng.pm, eng.tokenizer, ids, opts))
        for c in clock.calls if rep else []:
            if "rows" in c:
                on = {k: round(c[k] * 1e3, 2) for k in ("plan", "build", "read+trim", "update") if k in c}
                kind = "chained" if "build" not in c else "sync"
                print(p["category"], int(c["rows"]), kind, on, round(sum(on.values()), 2))
