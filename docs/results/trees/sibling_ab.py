"""Issue 43's second must-show at this machine's costs: the default decoder (the adapter's top-k tree beside the
chain, prompt lookup's other continuations) against chains plus one sibling (the tree cut to one runner-up of the
first draft, as before the top-k tree), side by side in one process. Per held-out prompt: AR, then PTP with each
variant in turn (the order alternating by round), every answer checked token for token against AR.

Usage: ``python docs/results/trees/sibling_ab.py [rounds] [temperature] [--free-rows] [--model M] [--adapter A]
[--prompts P] [--max-tokens N]`` from the repository root (defaults: the default model and adapter, the held-out
prompts, 128 tokens). ``--free-rows``: every row priced at nothing and calls built ahead (``ptp-bench --free-rows``):
tokens per call. The GPU check runs it once (``ptp_mlx/train/gpu_check.py``)."""

import argparse
import json

import ptp_mlx  # noqa: F401  (before mlx.core: MLX binds the BLAS ptp_mlx chooses)
from ptp_mlx.decode.chain_odds import choice_for
from ptp_mlx.drafting.cost import CostCurve
from ptp_mlx.drafting.lookup import LookupProposer
from ptp_mlx.drafting.topk_tree import SlotCandidates
from ptp_mlx.drafting.tree import TreeDrafter
from ptp_mlx.engine import Engine
from ptp_mlx.sampler import SamplingSettings

full_candidates, full_prior = TreeDrafter.candidates, TreeDrafter.prior_candidates
full_alternatives = LookupProposer.alternatives


def one_sibling(c: SlotCandidates | None) -> SlotCandidates | None:
    """The first slot's argmax and runner-up; every later slot its argmax only."""
    if c is None or not c.tokens:
        return c
    toks = (c.tokens[0][:2], *(t[:1] for t in c.tokens[1:]))
    probs = (c.probs[0][:2], *(p[:1] for p in c.probs[1:]))
    return SlotCandidates(toks, probs)


def variant(name: str) -> None:
    sib = name == "sibling"
    TreeDrafter.candidates = (lambda s, i: one_sibling(full_candidates(s, i))) if sib else full_candidates
    TreeDrafter.prior_candidates = (lambda s, conf: one_sibling(full_prior(s, conf))) if sib else full_prior
    LookupProposer.alternatives = (lambda s, *a, **k: []) if sib else full_alternatives


ap = argparse.ArgumentParser()
ap.add_argument("rounds", nargs="?", type=int, default=3)
ap.add_argument("temp", nargs="?", type=float, default=0.0)
ap.add_argument("--free-rows", action="store_true")
ap.add_argument("--model")
ap.add_argument("--adapter")
ap.add_argument("--prompts", default="ptp_mlx/data/heldout_prompts.jsonl")
ap.add_argument("--max-tokens", type=int, default=128)
a = ap.parse_args()
rounds, temp, free = a.rounds, a.temp, a.free_rows
S = SamplingSettings(temperature=temp, top_p=0.95 if temp else 1.0, seed=0)
eng = Engine.load(a.model, a.adapter)
if free:
    for b in [eng.budget, *eng.mode_budgets.values()]:
        if b is not None:
            b.curve = CostCurve([1, 64], [1.0, 1.0])
    choice_for(eng.pm).forced = True
prompts = [json.loads(line) for line in open(a.prompts) if line.strip()]


def run(p, mode):
    msgs = [{"role": "user", "content": p["turns"][0]}]
    steps = list(eng.generate(msgs, max_tokens=a.max_tokens, mode=mode, sampling=S))
    calls = sum(1 for s in steps if s.rows > 1)
    in_calls = sum(len(s.tokens) for s in steps if s.rows > 1)
    return sum(s.step_time for s in steps), [t for s in steps for t in s.tokens], calls, in_calls


run(prompts[0], "ar")  # warm-up: every shape compiles
for name in ("trees", "sibling"):
    variant(name)
    run(prompts[0], "ptp")
tot = {k: [0.0, 0, 0] for k in ("ar", "trees", "sibling")}
for r in range(rounds):
    for p in prompts:
        t_ar, ref, _, _ = run(p, "ar")
        tot["ar"][0] += t_ar
        for name in ("trees", "sibling") if r % 2 == 0 else ("sibling", "trees"):
            variant(name)
            t, toks, calls, in_calls = run(p, "ptp")
            assert toks == ref, f"{name} diverged from AR on {p.get('question_id', p.get('id'))}"
            tot[name][0] += t
            tot[name][1] += calls
            tot[name][2] += in_calls
    line = f"round {r + 1}: AR {tot['ar'][0]:.2f}s"
    for name in ("trees", "sibling"):
        t, calls, in_calls = tot[name]
        line += f" | {name} {t:.2f}s ({tot['ar'][0] / t:.3f}x AR, {in_calls / max(calls, 1):.2f} tokens per PTP call)"
    print(line + " | every answer identical to AR", flush=True)
