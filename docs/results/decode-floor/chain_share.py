"""The default drafter's chained share and host time on the path, per held-out prompt: what ``ptp-bench --profile``
reports for its first prompt, over every prompt (issue 40: at least 80% chained, host at most 0.5 ms median).

Usage: ``python docs/results/decode-floor/chain_share.py [prompts.jsonl] [max_tokens] [learnt|always|never]``
(default: the held-out prompts, 128 tokens, building ahead as learnt; greedy). One answer per prompt after a warm-up answer on the first."""

import statistics
import sys
from collections import Counter

from ptp_mlx.bench.profile import profile_default
from ptp_mlx.bench.prompts import load_prompts
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.engine import Engine
from ptp_mlx.prompt import encode_prompt
from ptp_mlx.sampler import SamplingSettings


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "ptp_mlx/data/heldout_prompts.jsonl"
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    eng = Engine.load()
    choice_for(eng.pm).forced = {"learnt": None, "always": True, "never": False}[
        sys.argv[3] if len(sys.argv) > 3 else "learnt"
    ]
    s = SamplingSettings()
    prompts = load_prompts(path)
    encode = lambda q: encode_prompt(eng.tokenizer, [{"role": "user", "content": q.turns[0]}])  # noqa: E731
    profile_default(eng, encode(prompts[0]), max_tokens, s)  # warm-up: the shapes compile
    calls = chained = 0
    hosts, why = [], Counter()
    for q in prompts:
        row = profile_default(eng, encode(q), max_tokens, s)
        if row is None:
            print(f"{q.question_id:24s} no PTP call")
            continue
        calls, chained = calls + row.calls, chained + row.chained
        why.update(row.why or {})
        hosts.append(row.host_on_path)
        print(
            f"{q.question_id:24s} calls {row.calls:3d} chained {row.chained:3d} ({row.chained / row.calls:4.0%})"
            f"  host on path median {row.host_on_path:5.2f} ms  tokens/call {row.tokens_per_call:.2f}"
        )
    print(
        f"all: {calls} PTP calls, {chained} chained ({chained / max(calls, 1):.0%}); per-prompt host medians: "
        f"median {statistics.median(hosts):.2f} ms"
    )
    print("built after the read: " + ", ".join(f"{v} {k}" for k, v in why.most_common()))


if __name__ == "__main__":
    main()
