"""Autoregressive decoding steps: the prefill, and mlx-lm's pipelined step loop (plain decoding and the bursts
inside a PTP run). Token ``g`` is ``pick(u[g], P(. | prefix))``, the same rule every PTP call verifies with."""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx

from ..sampler import UNRESOLVED, UniformStream, pick_with, resolve
from .session import CallRecord, DecodeSession

# Prompt rows per prefill pass. On the CPU 128: ptp-sgemm computes products of up to 256 rows faster than the BLAS
# there, and a 128-token prompt prefilled 622 -> 707 tokens a second, 512 tokens 628 -> 638 (docs/method.md section
# 10). On a GPU 512, as before: fewer passes to build, each enough to keep the device busy.
PREFILL_CHUNK = 128
GPU_PREFILL_CHUNK = 512


class Shifted:
    """The uniform stream seen from index ``start`` (an autoregressive burst inside a PTP run)."""

    def __init__(self, u: UniformStream, start: int):
        self.u, self.start = u, start

    def __getitem__(self, i: int) -> float:
        return self.u[self.start + i]


def prefill(model, tokens: list[int], cache, wait: bool = True) -> list[mx.array] | None:
    """Run ``tokens`` through ``model`` into ``cache``, in chunks (``PREFILL_CHUNK`` rows on the CPU). ``wait``
    False: the last chunk is queued and not waited for; returns its arrays (the first PTP call is built while it
    computes: ``DecodeSession.prefilling``), None where nothing is in flight."""
    chunk = PREFILL_CHUNK if mx.default_device() == mx.cpu else GPU_PREFILL_CHUNK
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[s : s + chunk])[None], cache=cache)
        state = [a for c in cache for a in c.state]
        if wait or s + chunk < len(tokens):
            mx.eval(state)  # sync per chunk: bounds memory on long prompts
        else:
            mx.async_eval(state)  # (the last chunk: the host goes on while it computes)
            return state
    return None


def ar_calls(
    sess: DecodeSession, last: int, max_new: int, then=None, stop=None
) -> Iterator[tuple[list[int], CallRecord]]:
    """Autoregressive decoding, pipelined like mlx-lm: the next pass is queued before the host reads a token.

    Yields ``([token], CallRecord)`` per step (with the token's logprobs when the session's logits hook asks for
    them); the session's cache gains each fed token (``last`` first). Its uniforms are read from index 0 (a burst
    inside a PTP run gets a ``Shifted`` stream); with its ``bank`` the steps are the fixed-shape ones of
    ``decode/fixed.py`` (run eagerly under a hook, which processes the logits). ``then``: called once with
    the last step's token (lazy int32 [1]) as soon as that step is queued, before any of it is read (a PTP call
    after a burst is built on it meanwhile: ``decode/pipeline.py``). ``stop()``: asked before each next step is
    queued; once True, the step already queued is read and the loop ends (a burst ended early keeps that token),
    and ``then`` is called with that step's token.

    A step's token may read ``UNRESOLVED`` (sampler.py: its ``u`` lies beyond the likeliest tokens the step sorts);
    the host then settles it from the step's logits, and the step queued on it runs again on the exact token."""
    base, cache, u, s, hook, bank = sess.pm.base, sess.cache, sess.uniforms, sess.settings, sess.hook, sess.bank

    def step(tok: mx.array, i: int) -> tuple[mx.array, list | None, mx.array | None]:
        """Queue step ``i`` on ``tok``: its token (lazy), a hook's scores, the logits ``resolve`` would read."""
        if bank is not None and hook is None:
            uu = mx.array([u[i]], dtype=mx.float32)
            t, logits = bank.ar_step(cache, s, tok.reshape(1).astype(mx.int32), uu, with_logits=True)
            return t, None, logits
        if bank is not None:  # the same fixed-shape pass, eagerly: the hook processes its logits
            logits = bank.ar_logits(cache, tok.reshape(1).astype(mx.int32))[-1]
        else:
            logits = base(tok.reshape(1, 1), cache=cache)[0, -1]
        if hook is None:  # (the full sort: a model's own cache may hold state that cannot be trimmed back)
            return pick_with(mx.array(u[i]), logits, s, check=False), None, None
        # The token fed at i > 0 is not committed yet (read back after this pass is queued): ``pending``.
        logits = hook.rows(logits[None], pending=tok if i > 0 else None)
        t = pick_with(mx.array([u[i]]), logits, s, check=False)
        return t[0], hook.score(logits, t), None

    t_queue = time.perf_counter()
    tok, scored, logits = step(mx.array([last]), 0)
    mx.async_eval(tok, *(scored or []))
    # Each step is charged its own queueing: the time spent queueing step i + 1 is that step's dispatch (on MLX's
    # CPU backend, a graph of more than about 100 kernels returns from ``async_eval`` only near its end: its compute).
    carried = time.perf_counter() - t_queue
    told = then is not None and max_new == 1
    if told:
        then(tok)
    for i in range(max_new):
        t_start = time.perf_counter()
        nxt = nxt_scored = None
        queued = 0.0
        stopped = stop is not None and i + 1 < max_new and stop()
        if i + 1 < max_new and not stopped:
            before = cache.offset
            nxt, nxt_scored, nxt_logits = step(tok, i + 1)
            mx.async_eval(nxt, *(nxt_scored or []))
            queued = time.perf_counter() - t_start
        elif stopped and then is not None and not told:
            told = True  # the step queued before the stop is the last: what follows is built on it meanwhile
            then(tok)
        t = int(tok.item())  # sync: the host needs this token (the next pass is already queued)
        if t == UNRESOLVED:
            t = resolve(u[i], logits.reshape(-1), s)
            if nxt is not None:  # queued on the unresolved token: again, on the exact one
                cache.trim_to(before)
                nxt, nxt_scored, nxt_logits = step(mx.array([t], dtype=mx.int32), i + 1)
                mx.async_eval(nxt, *(nxt_scored or []))
        if t < 0:
            raise ValueError("cannot sample: the model produced non-finite logits")
        if then is not None and nxt is not None and i + 2 == max_new and not told:
            told = True
            then(nxt)  # (built on a token the host has settled; ``nxt`` itself is checked when the call is)
        lps = hook.read(scored, [0], [t]) if scored is not None else None
        took = time.perf_counter() - t_start - queued + carried
        carried = queued
        yield [t], CallRecord(took, logprobs=lps)
        if nxt is None:
            return
        tok, scored, logits = nxt, nxt_scored, nxt_logits
