"""How long a read waits for its PTP call with nothing built meanwhile and after a build ahead, and how long the build
ahead takes (median ms), on the first eight held-out prompts (greedy, 128 tokens, every call built ahead that can be).

    python docs/results/decode-floor/chain-choice/rwait.py
"""

import json
import statistics
import time

import ptp_mlx  # noqa: F401  (the sgemm before MLX)
from ptp_mlx import generate
from ptp_mlx.decode import pipeline
from ptp_mlx.engine import Engine

waits: dict[str, list[float]] = {"after a build ahead": [], "nothing built": []}
builds: list[float] = []
read, chain, ptp_calls = pipeline.CallQueue.read, pipeline.CallQueue.chain, generate.ptp_calls


def timed_read(self, clock=pipeline.NO_CLOCK):
    key = "after a build ahead" if self.chained is not None else "nothing built"
    t = time.perf_counter()
    out = read(self, clock)
    waits[key].append(time.perf_counter() - t)
    return out


def timed_chain(self):
    t = time.perf_counter()
    chain(self)
    if self.chained is not None:
        builds.append(time.perf_counter() - t)


def always(*a, **k):
    k["chain"] = True
    return ptp_calls(*a, **k)


pipeline.CallQueue.read, pipeline.CallQueue.chain, generate.ptp_calls = timed_read, timed_chain, always
eng = Engine.load()
for line in list(open("ptp_mlx/data/heldout_prompts.jsonl"))[:8]:
    for _ in eng.generate(json.loads(line)["turns"][0], max_tokens=128):
        pass
for key, v in waits.items():
    print(f"read wait, {key}: {len(v)} reads, median {1e3 * statistics.median(v):.2f} ms")
print(f"build ahead: {len(builds)}, median {1e3 * statistics.median(builds):.2f} ms")
