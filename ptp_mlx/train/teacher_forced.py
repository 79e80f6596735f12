"""Teacher-forced exact-coupling data from plain text (the paper's "dataset" proposal; docs/method.md, section 6).

Generating teacher text costs an autoregressive decode per token. Instead, one teacher pass over any document
gives each token's bin ``[left, right)`` in the sampler's CDF at that position; a ``u`` drawn inside the bin makes
the document exactly the sample those ``u`` produce, so training windows can start anywhere in it. Documents are
placed as the assistant's answer inside the chat template (decoding always continues a chat turn).

Tokens outside the truncated support (top-k / top-p) have an empty bin: no ``u`` produces them. Such a record
keeps the empty bin and ``make_windows`` ends a window there (its later slots are not scored), or the data is
built with untruncated settings (``--temp 1.0``, no top-k / top-p), where every token has a bin.

Sources that install here, streamed document by document (nothing is materialised whole): the Python standard
library's own source, the ``chatterbot-corpus`` wheel's dialogs (the bot's replies as answers) and the ``gensim``
wheel's news paragraphs. Document ids carry a source prefix and a running number, so the project's validation
split (``data.is_validation``) holds out a fifth of every source. Resumable: documents already written are skipped.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..bins import bins
from ..prompt import encode_prompt
from ..sampler import SamplingSettings
from .corpora import chatterbot_dialogs, news_paragraphs
from .data import is_validation, read_records

CHUNK_CHARS = 1200  # a document chunk: about 300 tokens of code or prose
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "ensurepip"}


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Pieces of about ``size`` characters, cut at blank lines where possible."""
    buf = ""
    for para in text.split("\n\n"):
        if buf and len(buf) + len(para) > size:
            yield buf
            buf = ""
        buf = f"{buf}\n\n{para}" if buf else para
        while len(buf) > 2 * size:
            yield buf[:size]
            buf = buf[size:]
    if buf.strip():
        yield buf


def stdlib_documents() -> Iterator[tuple[str, str, str]]:
    """(category, instruction, text) for chunks of the standard library's Python source, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for k, chunk in enumerate(_chunks(text)):
            yield "coding", f"Write part {k + 1} of the Python module `{module}`.", chunk


def chatterbot_documents(wheel: Path) -> Iterator[tuple[str, str, str]]:
    """The English chatterbot dialogs: each opening line as the question, the reply as the answer."""
    for conv in chatterbot_dialogs(wheel):
        if len(conv) >= 2 and all(isinstance(c, str) for c in conv[:2]):
            yield "instruction", conv[0].strip(), " ".join(str(c).strip() for c in conv[1:])


def news_documents(wheel: Path) -> Iterator[tuple[str, str, str]]:
    """gensim's Lee news paragraphs, as answers to a request for a short news report."""
    for p in news_paragraphs(wheel):
        yield "instruction", "Write a short news report.", p


def documents(stdlib: bool, chatterbot: Path | None, gensim: Path | None) -> Iterator[tuple[str, str, str, str]]:
    """(id, category, instruction, text) from every chosen source, interleaved so any prefix mixes them."""
    sources = []
    if stdlib:
        sources.append(("py", stdlib_documents()))
    if chatterbot is not None:
        sources.append(("chat", chatterbot_documents(Path(chatterbot))))
    if gensim is not None:
        sources.append(("news", news_documents(Path(gensim))))
    counts = dict.fromkeys((s for s, _ in sources), 0)
    while sources:
        for src, it in list(sources):
            doc = next(it, None)
            if doc is None:
                sources.remove((src, it))
                continue
            yield (f"{src}-{counts[src]:05d}", *doc)
            counts[src] += 1


def teacher_forced_record(model, tokenizer, instruction: str, text: str, s: SamplingSettings, max_tokens: int):
    """One record: the chat prefix, the document as the answer (with the end token) and each answer token's bin
    under ``s``; an empty bin marks a token outside the truncated support."""
    prefix = encode_prompt(tokenizer, instruction)
    answer = list(tokenizer.encode(text, add_special_tokens=False))[:max_tokens]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and len(answer) < max_tokens:
        answer.append(int(eos))
    tokens = prefix + answer
    logits = model(mx.array(tokens[:-1])[None])[0, len(prefix) - 1 :]  # the pass that predicts each answer token
    lo, hi = bins(logits, mx.array(answer), s)
    mx.eval(lo, hi)  # sync: the bins go to the file
    return {
        "tokens": tokens,
        "start": len(prefix),
        "left": np.array(lo, dtype=np.float64).tolist(),
        "right": np.array(hi, dtype=np.float64).tolist(),
        "greedy": False,
        "source": "corpus",
    }


def build(
    model,
    tokenizer,
    out: Path,
    stdlib: bool = True,
    chatterbot: Path | None = None,
    gensim: Path | None = None,
    sampling: SamplingSettings = SamplingSettings(0.7, 50, 0.95),
    split: str = "train",
    limit: int | None = None,
    max_tokens: int = 384,
) -> int:
    """Append teacher-forced records for documents not yet in ``out``; returns how many were written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r.get("prompt_id") for r in read_records(out)}
    written, t0 = 0, time.perf_counter()
    bar = tqdm(total=limit, desc="teacher-forced", unit="doc", file=sys.stderr)
    with open(out, "a") as f:
        for doc_id, category, instruction, text in documents(stdlib, chatterbot, gensim):
            if limit is not None and written >= limit:
                break
            held_out = is_validation(doc_id)
            if doc_id in done or (split == "train" and held_out) or (split == "val" and not held_out):
                continue
            rec = teacher_forced_record(model, tokenizer, instruction, text, sampling, max_tokens)
            rec.update(prompt_id=doc_id, category=category, settings=sampling.as_dict())
            f.write(json.dumps(rec) + "\n")
            f.flush()  # one document at a time: an interrupted run loses at most one
            written += 1
            bar.update(1)
    bar.close()
    print(f"teacher-forced: {written} documents in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return written
