"""Decoding variants A/B in one process, for the scripts beside it: every held-out prompt answered by each variant
in turn (the order rotated per prompt, so the VM's drift hits all alike), every answer checked against the first
variant's (AR: PTP is lossless), after one warm-up answer per mode (every shape compiles)."""

import json
import time
from collections.abc import Callable, Iterator


def answer(eng, prompt: dict, mode: str, sampling, max_tokens: int = 128) -> tuple[float, float, list[int]]:
    """Seconds the answer's steps took, seconds the whole answer took (its prefill included), and its tokens."""
    messages = [{"role": "user", "content": prompt["turns"][0]}]
    t0 = time.perf_counter()
    steps = list(eng.generate(messages, mode=mode, sampling=sampling, max_tokens=max_tokens))
    wall = time.perf_counter() - t0
    return sum(s.step_time for s in steps), wall, [t for s in steps for t in s.tokens]


def interleave(
    eng, variants: dict[str, tuple[str, Callable[[], None]]], rounds: int, sampling
) -> Iterator[tuple[dict[str, float], dict[str, float]]]:
    """Each variant ``name: (mode, setup)`` (``setup()`` applies its settings before each answer) on every held-out
    prompt, ``rounds`` times; yields the seconds per variant so far after each round: of the decoding steps, and of
    the whole answers (prefill included)."""
    prompts = [json.loads(line) for line in open("ptp_mlx/data/heldout_prompts.jsonl")]
    for mode in dict.fromkeys(m for m, _ in variants.values()):
        answer(eng, prompts[0], mode, sampling)
    steps, wall = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
    order = list(variants)
    for _ in range(rounds):
        for p in prompts:
            ref = None
            for name in order:
                mode, setup = variants[name]
                setup()
                t, w, toks = answer(eng, p, mode, sampling)
                ref = ref or toks
                assert toks == ref, f"{name} on {p['question_id']}: the answer differs from the other variants'"
                steps[name] += t
                wall[name] += w
            order = order[1:] + order[:1]
        yield dict(steps), dict(wall)
