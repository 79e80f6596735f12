"""``ptp-bench --chat-turns N``: what carrying a conversation's KV cache from turn to turn saves.

One conversation of N user turns (taken from the benchmark prompts in order) is answered twice per repeat,
interleaved: once continuing from the previous turn's cache (as ``ptp-chat`` does) and once prefilling the whole
chat every turn. Both must give the same answers (same uniforms); the table reports the prompt tokens each
turn prefilled and the seconds that took.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampler import SamplingSettings


@dataclass
class TurnFigures:
    prompt_tokens: int = 0
    prefilled: int = 0
    seconds: float = 0.0
    answer: list[int] = field(default_factory=list)


def converse(engine, turns: list[str], mode: str, sampling: SamplingSettings, max_tokens: int, reuse: bool):
    """Answer ``turns`` as one chat; per turn, the prompt size, tokens prefilled, prefill seconds, answer."""
    cache = engine.new_prompt_cache() if reuse else None
    messages: list[dict] = []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = engine.encode(messages)
        fig = TurnFigures(prompt_tokens=len(ids))
        answer = ""
        for st in engine.generate(ids, mode=mode, sampling=sampling, max_tokens=max_tokens, prompt_cache=cache):
            fig.seconds = st.prompt_time
            fig.answer.extend(st.tokens)
            answer += st.text
        fig.prefilled = len(ids) - 1 - (cache.reused if cache is not None else 0)
        out.append(fig)
        messages.append({"role": "assistant", "content": answer})
    return out


def chat_table(engine, prompts, n_turns: int, mode: str, sampling: SamplingSettings, max_tokens: int, repeats: int):
    """Run the comparison and return ``(table text, ok)``; ``ok`` is False if the answers differ."""
    turns = [t for p in prompts for t in p.turns][:n_turns]
    best: dict[bool, list[TurnFigures]] = {}
    for _ in range(repeats):
        for reuse in (True, False):  # interleaved: both see the same machine load
            figs = converse(engine, turns, mode, sampling, max_tokens, reuse)
            old = best.get(reuse)
            best[reuse] = (
                figs if old is None else [a if a.seconds <= b.seconds else b for a, b in zip(old, figs, strict=True)]
            )
    ok = [f.answer for f in best[True]] == [f.answer for f in best[False]]
    lines = [
        f"chat of {len(turns)} turns, mode {mode}, {'greedy' if sampling.greedy else 'sampled'}, "
        f"best of {repeats}: prefill per turn, carried cache vs full re-prefill",
        "| turn | prompt tokens | prefilled (carried) | prefill s (carried) | prefilled (full) | prefill s (full) |",
        "|---|---|---|---|---|---|",
    ]
    for i, (a, b) in enumerate(zip(best[True], best[False], strict=True), 1):
        lines.append(f"| {i} | {a.prompt_tokens} | {a.prefilled} | {a.seconds:.3f} | {b.prefilled} | {b.seconds:.3f} |")
    ta, tb = sum(f.seconds for f in best[True]), sum(f.seconds for f in best[False])
    lines.append(
        f"total prefill: {ta:.3f} s carried vs {tb:.3f} s full ({tb - ta:.3f} s saved, "
        f"{sum(f.prefilled for f in best[True])} vs {sum(f.prefilled for f in best[False])} tokens); "
        f"answers identical: {'yes' if ok else 'NO'}"
    )
    return "\n".join(lines), ok
