"""Distillation prompts shaped like what users ask a local model: questions and summaries over a passage they
give, several passages as context (RAG), translation both ways, and chats of several turns.

The development prompts are instructions, maths and code only, and the shipped adapter drafts worse on the other
kinds (docs/results/user-tasks/: 1.91 tokens per window against 2.01, translations 1.39). These prompts fill that
gap from the same two wheels ``corpora.py`` reads (the Lee news paragraphs of gensim's test data; chatterbot's
dialogs, English and six other languages), wrapped in templates written here. A chat's later turns follow the teacher's own answers: ``pregenerate`` answers the earlier
turns first (``turns`` holds the user's messages only, as Spec-Bench's multi-turn prompts do).
"""

from __future__ import annotations

import random
import re
import zipfile
from pathlib import Path

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
CORPUS_LANGUAGE = {"spanish": "Spanish", "french": "French", "german": "German", "italian": "Italian",
                   "portuguese": "Portuguese", "dutch": "Dutch"}  # fmt: skip

QUESTIONS = [
    "What does the passage say about {e}?",
    "Why is {e} mentioned in the text?",
    "What role does {e} play in these events?",
    "According to the text, what happened involving {e}?",
]
GENERAL_QUESTIONS = [
    "What is the main point of the passage?",
    "Who is involved, and what did each of them do?",
    "What happened first, and what happened as a result?",
    "Which facts in the passage are numbers or dates, and what do they refer to?",
    "Is the tone of this text neutral or opinionated? Quote a phrase that shows it.",
]
QA_FORMS = [
    "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: {q}",
    "{p}\n\nBased only on the text above: {q}",
    "Answer the question using the passage. If the passage does not say, answer that it does not.\n\n"
    "Passage:\n{p}\n\nQuestion: {q}\nAnswer:",
]
SUMMARIES = [
    "Summarize this in one sentence:\n\n{p}",
    "Give a three-bullet summary of the following text.\n\n{p}",
    "TL;DR:\n\n{p}",
    "Rewrite this passage in plain, simple words, keeping every fact.\n\n{p}",
    "Summarize the text below for someone who has no time, then list the names it mentions.\n\n{p}",
]
RAG_FORMS = [
    "Use the documents to answer the question.\n\nDocument 1:\n{a}\n\nDocument 2:\n{b}\n\nQuestion: {q}",
    "Context:\n[1] {a}\n[2] {b}\n\nAnswer from the context and cite [1] or [2]: {q}",
]
TO_LANGUAGE = [
    "Translate into {lang}:\n\n{t}",
    "Translate the following text from English to {lang}.\n\n{t}",
    'How would you say this in {lang}? "{t}"',
]
TO_ENGLISH = [
    "Translate into English: {t}",
    "Translate this {lang} sentence into English and explain any idiom in it.\n\n{t}",
    'What does this mean in English? "{t}"',
]
FOLLOW_UPS = [
    "Can you explain that more simply?",
    "Give me a concrete example.",
    "Summarize your answer in one sentence.",
    "Why is that? Please explain your reasoning.",
    "Now write it as a short list.",
    "Translate your last answer into French.",
    "What would be a common mistake here?",
    "Can you make it shorter?",
]

_RUN = re.compile(r"\b[A-Z][a-z]+(?:\s[A-Z][a-z]+)*")
_STOP = set(
    "The This That These Those It He She They We Mr Mrs In On But "
    "President Prime Minister Government Senator Police Premier Opposition Federal".split()
)  # capitalised words that are no name by themselves


def sentences(text: str) -> list[str]:
    """The text's sentences (split after ., ! or ? followed by a space)."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def names(text: str) -> list[str]:
    """Capitalised words or runs of them that do not start a sentence: the passage's names, in order, once each."""
    found = []
    for m in _RUN.finditer(text):
        words = m.group(0).split()
        starts = m.start() == 0 or re.search(r"[.!?]\s+$", text[: m.start()]) is not None
        if starts and len(words) == 1:
            continue  # a capitalised first word of a sentence: not a name by its case alone
        while words and words[0] in _STOP:
            words = words[1:]
        if words and not (len(words) == 1 and words[0] in _STOP):
            found.append(" ".join(words))
    return list(dict.fromkeys(found))


def _question(p: str, r: random.Random) -> str:
    found = names(p)
    if found and r.random() < 0.6:
        return r.choice(QUESTIONS).format(e=r.choice(found[:6]))
    return r.choice(GENERAL_QUESTIONS)


def passage_tasks(paragraphs: list[str], r: random.Random) -> list[tuple[str, str, list[str]]]:
    """Per paragraph one question over it and one summary; per pair of paragraphs one RAG question."""
    rows = []
    for p in paragraphs:
        rows.append(("passage-qa", "qa", [r.choice(QA_FORMS).format(p=p, q=_question(p, r))]))
        rows.append(("passage-sum", "summarization", [r.choice(SUMMARIES).format(p=p)]))
    order = list(paragraphs)
    r.shuffle(order)
    for a, b in zip(order[::2], order[1::2], strict=False):
        which = r.choice([a, b])
        rows.append(("rag", "rag", [r.choice(RAG_FORMS).format(a=a, b=b, q=_question(which, r))]))
    return rows


def translation_tasks(
    paragraphs: list[str], foreign: dict[str, list[str]], r: random.Random
) -> list[tuple[str, str, list[str]]]:
    """English sentences (one to three of a paragraph) into another language, and chatterbot lines of six other
    languages into English."""
    rows = []
    for p in paragraphs:
        ss = sentences(p)
        k = r.randint(0, max(0, len(ss) - 1))
        text = " ".join(ss[k : k + r.randint(1, 3)])
        rows.append(("to-lang", "translation", [r.choice(TO_LANGUAGE).format(lang=r.choice(LANGUAGES), t=text)]))
    for lang, lines in sorted(foreign.items()):
        for t in lines:
            rows.append(("to-en", "translation", [r.choice(TO_ENGLISH).format(lang=lang, t=t)]))
    return rows


def chat_tasks(openers: list[str], r: random.Random, per: int = 1) -> list[tuple[str, str, list[str]]]:
    """Chats of two or three user turns: an opening question, then follow-ups about the answer it got."""
    rows = []
    for q in openers:
        for _ in range(per):
            turns = [q, *r.sample(FOLLOW_UPS, r.choice([1, 1, 2]))]
            rows.append(("thread", "conversation", turns))
    return rows


def foreign_lines(wheel: Path, per_language: int = 120) -> dict[str, list[str]]:
    """Lines of four words or more from chatterbot's dialogs in the languages of ``CORPUS_LANGUAGE``, read in place
    (at most ``per_language`` each, the first ones in file order)."""
    import yaml

    out: dict[str, list[str]] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or parts[2] not in CORPUS_LANGUAGE or not name.endswith(".yml"):
                continue
            lines = out.setdefault(CORPUS_LANGUAGE[parts[2]], [])
            for conv in (yaml.safe_load(z.read(name)) or {}).get("conversations") or []:
                lines += [t.strip() for t in conv if isinstance(t, str) and len(t.split()) >= 4]
    return {lang: list(dict.fromkeys(v))[:per_language] for lang, v in out.items() if v}
