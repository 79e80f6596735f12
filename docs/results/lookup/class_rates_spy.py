"""Lookup hit rates by match-length class: wraps ``ptp-bench`` and counts, per class of the match behind each verified
lookup chain (``LookupProposer.match_class``), the calls, the drafts that stood and the chains that fell short.

Usage: ``python docs/results/lookup/class_rates_spy.py --prompts docs/results/lookup/dev15.jsonl --max-tokens 128
--methods ptp --no-warmup``."""

import atexit
import sys
from collections import defaultdict

from ptp_mlx.bench.cli import main
from ptp_mlx.drafting import lookup

stats = defaultdict(lambda: [0, 0, 0])  # class -> calls, hits, misses
_obs = lookup.LookupProposer.observe


def observe(self, proposed, accepted, cost):
    at = self._current()
    if at is not None:
        k = self.match_class(self.history, at)
        s = stats[k]
        s[0] += 1
        s[1] += accepted
        s[2] += accepted < proposed
    _obs(self, proposed, accepted, cost)


@atexit.register
def report():
    for k in sorted(stats):
        c, h, m = stats[k]
        print(f"SPY class {k}: calls {c} hits {h} misses {m} rate {h / max(1, h + m):.2f}")


lookup.LookupProposer.observe = observe
sys.exit(main(sys.argv[1:]))
