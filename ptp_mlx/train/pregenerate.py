"""Phase 1 of distillation: the base model writes teacher completions with their sampler bins.

All completions of one prompt decode together as a batch (same prompt, so no padding): the prompt is
prefilled once and its cache repeated over the batch. Row 0 can be greedy, the other rows sample with the
exact sampler; each sampled token's bin ``[F(t) - p(t), F(t))`` is stored so training can draw ``u`` inside it.
Resumable: prompts already in the output file are skipped.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache
from tqdm import tqdm

from ..bins import bins, pick_with_bins
from ..errors import UserError
from ..model.layers import install, make_cache
from ..prompt import encode_prompt
from ..sampler import SamplingSettings
from .data import read_prompts, read_records

OTHER_ORDER = {"id": "prob", "prob": "id"}


def _decode(model, cache, last: mx.array, n: int, greedy_first: bool, s, max_new: int, eos: set[int], rngs):
    """Decode ``n`` rows per prompt from a filled cache; row 0 of each prompt greedy if ``greedy_first``.

    Returns tokens [rows, steps] and left and right bin edges [rows, steps, 2] (``s.order``, then the other).
    """
    rows = last.shape[0]
    greedy_rows = mx.array([greedy_first and r % n == 0 for r in range(rows)])
    toks, lefts, rights = [], [], []
    done = np.zeros(rows, dtype=bool)
    for _ in range(max_new):
        logits = model(last, cache=cache)[:, -1].astype(mx.float32)
        # Each prompt draws from its own stream, so its samples do not depend on which prompts share the batch.
        u = mx.array(np.concatenate([g.random(n, dtype=np.float32) for g in rngs]))
        t, left, right = pick_with_bins(u, logits, s)
        t = mx.where(greedy_rows, mx.argmax(logits, axis=-1).astype(mx.int32), t)
        # The same tokens' bins in the other CDF order, recorded now so training never re-bins.
        lo2, hi2 = bins(logits, t, s, OTHER_ORDER[s.order])
        left, right = mx.where(greedy_rows, 0.0, left), mx.where(greedy_rows, 1.0, right)
        lo2, hi2 = mx.where(greedy_rows, 0.0, lo2), mx.where(greedy_rows, 1.0, hi2)
        mx.eval(t, left, right, lo2, hi2)  # sync: stopping needs the tokens on the host
        tl = np.array(t)
        toks.append(tl)
        lefts.append(np.stack([np.array(left), np.array(lo2)], -1))
        rights.append(np.stack([np.array(right), np.array(hi2)], -1))
        done |= np.isin(tl, list(eos))
        if done.all():
            break
        last = t[:, None]
    return np.stack(toks, 1), np.stack(lefts, 1), np.stack(rights, 1)


def _complete(model, prompt_ids: list[int], n: int, greedy_first: bool, s, max_new: int, eos: set[int], rng):
    """``n`` completions of one prompt: the prompt is prefilled once and its cache repeated over the batch."""
    cache = make_cache(model, install(model))  # plain KV caches in every layer, sliding ones included
    model(mx.array(prompt_ids[:-1])[None], cache=cache)
    cache.repeat(n)
    last = mx.array([prompt_ids[-1]] * n)[:, None]
    T, L, R = _decode(model, cache, last, n, greedy_first, s, max_new, eos, [rng])
    return _records(prompt_ids, T, L, R, greedy_first, eos, s.order)


def _complete_many(model, prompts: list[list[int]], n: int, greedy_first: bool, s, max_new: int, eos, rngs):
    """``_complete`` for several prompts in one left-padded batch (``n`` rows each); one list per prompt."""
    ids = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in ids)
    pad = [width - len(p) for p in ids]
    cache = [BatchKVCache(pad) for _ in model.layers]
    x = mx.array([[0] * k + p for k, p in zip(pad, ids, strict=True)])
    model(x[:, :-1], cache=cache)
    T, L, R = _decode(model, cache, x[:, -1:], n, greedy_first, s, max_new, eos, rngs)
    return [
        _records(p, T[i * n : (i + 1) * n], L[i * n : (i + 1) * n], R[i * n : (i + 1) * n], greedy_first, eos, s.order)
        for i, p in enumerate(prompts)
    ]


def _records(prompt_ids, T, L, R, greedy_first: bool, eos: set[int], order: str) -> list[dict]:
    other = OTHER_ORDER[order]
    out = []
    for r in range(T.shape[0]):
        row = T[r].tolist()
        end = next((i + 1 for i, x in enumerate(row) if x in eos), len(row))  # keep EOS: drafts learn to stop
        rec = {
            "tokens": prompt_ids + row[:end],
            "start": len(prompt_ids),
            "left": [float(x) for x in L[r, :end, 0]],  # full precision: a u drawn inside picks this token
            "right": [float(x) for x in R[r, :end, 0]],
            "greedy": bool(greedy_first and r == 0),
            f"left_{other}": [float(x) for x in L[r, :end, 1]],  # the same tokens' bins in the other CDF order
            f"right_{other}": [float(x) for x in R[r, :end, 1]],
        }
        if order != "id":
            rec["order"] = order
        out.append(rec)
    return out


def _chats(model, tokenizer, prompts, s, max_new: int, eos: set[int], max_prompt: int, batch: int) -> dict:
    """Each prompt's chat up to its last user turn: a prompt of several ``turns`` gets the teacher's own greedy
    answer after each earlier one, as a chat with it would have (answered turn by turn, ``batch`` prompts at once).
    """
    chats = {p["id"]: [{"role": "user", "content": p["turns"][0]}] for p in prompts}
    for k in range(1, max((len(p["turns"]) for p in prompts), default=1)):
        later = [p for p in prompts if len(p["turns"]) > k]
        for i in range(0, len(later), batch):
            group = later[i : i + batch]
            ids = [encode_prompt(tokenizer, chats[p["id"]])[-max_prompt:] for p in group]
            rngs = [np.random.default_rng(0) for _ in group]  # (greedy rows draw no uniform)
            rows = _complete_many(model, ids, 1, True, s, max_new, eos, rngs)
            for p, (rec,) in zip(group, rows, strict=True):
                answer = [t for t in rec["tokens"][rec["start"] :] if t not in eos]
                chats[p["id"]] += [
                    {"role": "assistant", "content": tokenizer.decode(answer)},
                    {"role": "user", "content": p["turns"][k]},
                ]
    return chats


def pregenerate(
    model,
    tokenizer,
    prompts_file: Path,
    out_file: Path,
    n: int = 16,
    greedy_first: bool = True,
    sampling: SamplingSettings = SamplingSettings(0.7, 50, 0.95),
    max_new: int = 96,
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    max_prompt: int = 768,
    greedy_only: bool = False,
    batch_prompts: int = 1,
    deadline: float | None = None,
) -> int:
    """Append completions for every prompt not yet in ``out_file``. Returns the number of new records.

    ``deadline`` (a ``time.perf_counter()`` value): start no new batch after it (a time-boxed run)."""
    prompts = read_prompts(prompts_file, split=split)[: limit or None]
    if not prompts:
        raise UserError(
            f"no prompts of split {split!r} in {prompts_file} (ids ending in 0 or 5 are the validation split)"
        )
    done = {r["prompt_id"] for r in read_records(out_file)}
    todo = [p for p in prompts if p["id"] not in done]
    eos = set(tokenizer.eos_token_ids)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    written = tokens = 0
    t0 = time.perf_counter()
    n_rows = 1 if greedy_only else n
    greedy_first = greedy_first or greedy_only
    # (a chat's first turn stands for its length here: its later turns are answered batch by batch, below)
    encoded = [(p, encode_prompt(tokenizer, p["turns"][0])[-max_prompt:]) for p in todo]
    if batch_prompts > 1:  # similar lengths share a batch (less left padding), sorted within blocks
        block = batch_prompts * 8  # so that a partial run still covers the file's mix of prompts
        encoded = [
            e for i in range(0, len(encoded), block) for e in sorted(encoded[i : i + block], key=lambda pe: len(pe[1]))
        ]
    groups = [encoded[i : i + batch_prompts] for i in range(0, len(encoded), batch_prompts)]
    bar = tqdm(total=len(encoded), desc="pregenerate", unit="prompt", file=sys.stderr)
    with open(out_file, "a") as f:
        for group in groups:
            if deadline is not None and time.perf_counter() > deadline:
                print("pregenerate: time budget reached", file=sys.stderr)
                break
            if any(len(p["turns"]) > 1 for p, _ in group):
                chats = _chats(model, tokenizer, [p for p, _ in group], sampling, max_new, eos, max_prompt, len(group))
                group = [(p, encode_prompt(tokenizer, chats[p["id"]])[-max_prompt:]) for p, _ in group]
            rngs = [np.random.default_rng([seed, zlib.crc32(p["id"].encode())]) for p, _ in group]
            if len(group) == 1:
                rows_per = [_complete(model, group[0][1], n_rows, greedy_first, sampling, max_new, eos, rngs[0])]
            else:
                ids = [e for _, e in group]
                rows_per = _complete_many(model, ids, n_rows, greedy_first, sampling, max_new, eos, rngs)
            for (p, _), rows in zip(group, rows_per, strict=True):
                for r in rows:
                    r.update(
                        prompt_id=p["id"],
                        category=p["category"],
                        settings={**sampling.as_dict(), "greedy": r["greedy"]},
                    )
                    f.write(json.dumps(r) + "\n")
                    tokens += len(r["tokens"]) - r["start"]
                written += len(rows)
            f.flush()  # one batch at a time: an interrupted run loses at most one batch
            bar.update(len(group))
    bar.close()
    print(
        f"pregenerate: {written} completions for {len(todo)} prompts in {time.perf_counter() - t0:.0f} s"
        f" ({tokens / max(time.perf_counter() - t0, 1e-9):.0f} teacher tokens/s)",
        file=sys.stderr,
    )
    return written
