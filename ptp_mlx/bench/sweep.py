"""``ptp-bench --cost-sweep``: from which model size PTP's call pays on this machine.

A PTP call verifies and drafts in one pass of several rows; it pays when that pass costs little more than a plain
step. How much more depends on the machine (a GPU's flat cost curve, a CPU's compute-bound rows) and on the model's
size (a bigger model moves more weights per row, which extra rows share). The sweep prices, on random-weight Llama
models of the default model's shape and of 0.5B, 1.5B and 3B shapes (no download: the cost of a pass does not
depend on the weights' values), a plain step against PTP calls of 4, 8 and 16 rows, all as the compile bank runs
them (fixed-shape, compiled), after a prefill of ``context`` tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import blas
from ..errors import UserError
from ..paths import atomic_write_bytes

# Llama shapes (hidden, layers, heads, KV heads, MLP, vocabulary): the default model's, then those of common
# 0.5B / 1.5B / 3B models.
SIZES = {
    "135m": (576, 30, 9, 3, 1536, 49152),
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "1.5b": (1536, 28, 12, 2, 8960, 151936),
    "3b": (2048, 36, 16, 2, 11008, 151936),
}
# rows -> (drafts, branches): a PTP call of that many rows (token rows, then auxiliaries).
CALLS = {4: (0, [(0, 3)]), 8: (1, [(0, 3), (1, 3)]), 16: (3, [(0, 3), (1, 3), (2, 3), (3, 3)])}


def random_model(size: str, dtype=mx.float32, codes: bool = True):
    """A Llama model of ``SIZES[size]`` with random weights (mlx-lm's own class) and a random rank-16 adapter.
    ``codes`` (float32): the weights as the default model's (a Q4_1 / Q8_0 GGUF converted to float32), read by
    ptp-sgemm from their codes as the default model's are (``kernels.packed``)."""
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    from ..adapter import randomize_adapter
    from ..kernels import packed
    from ..model.layers import weight_matrices
    from ..model.ptp import PTPAdapter, PTPModel

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    if codes and dtype == mx.float32:

        def as_gguf(p: mx.array, bits: int) -> mx.array:
            if p.ndim != 2 or p.shape[1] % packed.GROUP:
                return p
            return mx.array(packed.gguf_round_trip(np.asarray(p), bits))

        # the default model's file: Q4_1 projections, a Q8_0 embedding; one block at a time, so the 3B shape never
        # holds two copies of its weights
        for part, bits in [*((layer, 4) for layer in model.model.layers), (model.model.embed_tokens, 8)]:
            part.update(tree_map(lambda p, b=bits: as_gguf(p, b), part.parameters()))
            mx.eval(part.parameters())
    mx.eval(model.parameters())
    adapter = PTPAdapter(model, 16, 2.0, "binary")
    randomize_adapter(adapter, seed=0)
    mx.eval(adapter.parameters())
    pm = PTPModel(model, adapter, {"window": 8}, fuse=True)
    if codes and dtype == mx.float32:
        packed.pack_model(weight_matrices(model), cache=False)  # after fusing: the fused groups' views
    packed.pack_halves(pm.lora_matrices())
    return pm


def call_timers(pm, context: int = 128):
    """A plain step and, per ``DraftPlan``, a PTP call, each a synchronised function that runs once on a cache of
    ``context`` tokens and trims it back (fixed-shape and compiled, as the compile bank runs them; the first run of
    each builds its graph)."""
    from ..decode.ar import prefill
    from ..decode.call import build_call, finish_call
    from ..decode.fixed import bank_for
    from ..decode.session import DecodeSession
    from ..sampler import SamplingSettings, UniformStream

    bank = bank_for(pm, True)
    s, u = SamplingSettings(), UniformStream(0)
    cache = pm.make_cache()
    prefill(pm.base, [1 + i % 500 for i in range(context)], cache)
    mx.eval(cache.arrays())

    def step():
        t = bank.ar_step(cache, s, mx.array([3], dtype=mx.int32), mx.array([0.5], dtype=mx.float32))
        mx.eval(t, cache.arrays())  # sync: we are timing the step
        cache.trim_to(context)

    sess = DecodeSession(pm, cache, u, s, 1.0, bank=bank)

    def call_for(plan):
        def call():
            finish_call(cache, build_call(sess, 3, plan, 0))  # (finish_call reads the outputs: a sync)
            cache.trim_to(context)

        return call

    return step, call_for


def price(pm, context: int = 128, repeats: int = 5) -> dict[str, float]:
    """Milliseconds of a plain step and of a PTP call of each ``CALLS`` width, each on a cache of ``context``
    tokens: the best of ``repeats`` rounds, each round timing the step and every width back to back (after one
    untimed warm-up that builds the compiled graphs), so a shared machine's slow phase meets them all alike."""
    from ..drafting.protocol import DraftPlan

    step, call_for = call_timers(pm, context)
    fns = {"step": step, **{f"ptp {rows}": call_for(DraftPlan([5] * n, br)) for rows, (n, br) in CALLS.items()}}
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1000.0 * sec for name, sec in best.items()}


def sweep_table(sizes: list[str], context: int = 128, repeats: int = 5, log=print) -> tuple[str, dict]:
    """One line per model size: a plain step's milliseconds and each PTP width's, as a multiple of the step."""
    from ..kernels import packed
    from ..model.layers import weight_matrices

    unknown = [x for x in sizes if x not in SIZES]
    if unknown:
        raise ValueError(f"unknown sweep size {unknown[0]!r} (known: {', '.join(SIZES)})")
    doc, lines = {}, []
    head = ["model shape", "params", "plain step ms"] + [f"ptp {r} rows (x step)" for r in CALLS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # (PTP_MLX_PACKED=0 keeps the registry but registers nothing: both say whether the codes were read)
    codes = packed.enabled() and packed.registry() is not None
    for size in sizes:
        log(f"cost sweep: {size} ...")
        pm = random_model(size)
        n_params = sum(v.size for _, v in tree_flatten(pm.base.parameters()))
        matrices = weight_matrices(pm.base) + pm.lora_matrices()
        # Read from codes, then (the same weights) as floats: the second line is where the rows' cost is the
        # weights' reading, the first where the codes made reading cheap and the rows' multiply-adds show.
        for name, ms in _prices(pm, matrices, codes, context, repeats, size):
            doc[name] = {**ms, "params": n_params}
            cells = [f"{ms[f'ptp {r}']:.1f} ({ms[f'ptp {r}'] / ms['step']:.2f})" for r in CALLS]
            lines.append("| " + " | ".join([name, f"{n_params / 1e6:.0f}M", f"{ms['step']:.1f}", *cells]) + " |")
        packed.unpack_model(matrices)  # (the registry keeps them alive)
        del pm, matrices
        mx.clear_cache()
    how = "read from codes, then as floats" if codes else "read as floats (PTP_MLX_PACKED=0, or no codes path here)"
    text = (
        f"ptp-bench --cost-sweep | {mx.default_device()} | blas {blas.state['blas'].split(':')[0]} | random-weight "
        f"Llama shapes, fp32 from 4/8-bit codes as the default model ({how}), context {context}, best of {repeats} "
        "interleaved rounds\n"
    )
    return text + "\n".join(lines), doc


def _prices(pm, matrices: list, codes: bool, context: int, repeats: int, size: str):
    """``(line name, price(...))`` with the weights read from codes (where they are), then as floats."""
    from ..kernels import packed

    if codes:
        yield size, price(pm, context, repeats)
        packed.unpack_model(matrices)
        yield f"{size} (floats)", price(pm, context, repeats)
    else:
        yield size, price(pm, context, repeats)


def cost_sweep(args) -> int:
    """``ptp-bench --cost-sweep SIZES``: the table on stdout (and ``--json``); a bad size is a ``UserError``."""
    sizes = list(SIZES) if args.cost_sweep == "all" else [x.strip() for x in args.cost_sweep.split(",") if x.strip()]
    try:
        text, doc = sweep_table(sizes, log=lambda m: print(m, file=sys.stderr))
    except ValueError as e:
        raise UserError(str(e)) from None
    print(text)
    if args.json:
        atomic_write_bytes(Path(args.json), (json.dumps({"cost_sweep": doc}, indent=1) + "\n").encode())
    return 0
