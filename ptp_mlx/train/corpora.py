"""More distillation prompts: registry-installable text plus templated maths and coding tasks.

The 257 development prompts are far too few to distil from (docs/method.md, section 12: the feasibility run
plateaued from lack of data). This builds a larger prompt file in the same schema (``id``, ``category``,
``turns``) from:

- the ``chatterbot-corpus`` wheel (BSD-3): the opening line of each dialog, as a chat question;
- the ``gensim`` wheel's test data: the Lee news paragraphs, wrapped in a few instruction templates;
- templated arithmetic/algebra word problems and programming tasks written here, with random numbers
  and names from a fixed seed;
- with ``user_tasks``, ``user_tasks.py``'s questions, summaries and translations over the same text, and chats.

Wheels are read in place (``pip download --no-deps chatterbot-corpus==1.3.3 gensim==4.3.3``; any gensim 4), nothing is
installed or fetched at run time. Ids carry a source prefix and a running number, so the project's
validation split (``data.is_validation``) holds out a fifth of every source.
"""

from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path

from ..errors import UserError
from . import user_tasks as ut

NEWS_TEMPLATES = [
    "Summarize the following news report in two sentences.\n\n{t}",
    "Write a short headline for this story, then explain it in one paragraph.\n\n{t}",
    "What are the three most important facts in this text?\n\n{t}",
    "Explain this news to a ten-year-old.\n\n{t}",
    "Write three questions a reader might ask after reading this, and answer them.\n\n{t}",
]

NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kofi", "Lena", "Mia"]
ITEMS = ["apples", "pencils", "stickers", "books", "cookies", "marbles", "cards", "eggs", "flowers", "coins"]


def _math_problem(r: random.Random) -> str:
    n1, n2 = r.sample(NAMES, 2)
    it = r.choice(ITEMS)
    a, b, c = r.randint(3, 60), r.randint(2, 25), r.randint(2, 9)
    price = r.choice([0.25, 0.5, 0.75, 1.2, 1.5, 2, 2.5, 3, 4.5, 5, 12])
    kinds = [
        f"{n1} has {a} {it}. {n2} gives {n1} {b} more, and then {n1} shares them equally among {c} friends. "
        f"How many {it} does each friend get, and how many are left over?",
        f"A box holds {c} {it}. {n1} buys {a} boxes and gives away {b} {it}. How many {it} does {n1} have now?",
        f"{n1} sells {it} for ${price} each. On Monday {n1} sells {a} and on Tuesday {b} more than on Monday. "
        f"How much money does {n1} make in the two days?",
        f"{n1} reads {b} pages a day. The book has {a * c + b} pages. How many days does it take to finish it?",
        f"A train travels {a * 5} km in {c} hours. At the same speed, how far does it travel in {c + b} hours?",
        f"What is {r.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {a * 20}? Show your work.",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"Solve for x: {a}x - {b} = {c}x + {a * 3 - b}. Explain each step.",
        f"Simplify the fraction {a * c}/{b * c} and write it as a mixed number if it is larger than 1.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"{n1} is {c} times as old as {n2}. Together they are {(c + 1) * b} years old. How old is each?",
        f"The average of four numbers is {a}. Three of them are {a - c}, {a + b} and {a}. What is the fourth?",
        f"A shirt costs ${a + 10}. It is discounted by {r.choice([10, 20, 25, 30, 50])}%, then a {c}% tax is "
        "added. What is the final price?",
        f"How many minutes are there in {c} hours and {b} minutes? How many seconds is that?",
        f"What is the sum of all whole numbers from 1 to {a * 2}?",
        f"Find the greatest common divisor and the least common multiple of {a * c} and {b * c}.",
        f"A recipe needs {c} cups of flour for {b} cookies. How many cups are needed for {b * a} cookies?",
        f"{n1} saves ${b} every week. How many weeks until {n1} can buy a bike that costs ${b * a + c}?",
    ]
    tail = r.choice(["", " Solve it step by step.", " Explain your reasoning.", " Give the final answer at the end."])
    return r.choice(kinds) + tail


CODE_TASKS = [
    ("reverse_words", "s", "reverses the order of the words in a sentence"),
    ("is_palindrome", "s", "checks whether a string is a palindrome, ignoring case and spaces"),
    ("count_vowels", "s", "counts the vowels in a string"),
    ("fizzbuzz", "n", "returns the FizzBuzz sequence from 1 to n as a list of strings"),
    ("fibonacci", "n", "returns the first n Fibonacci numbers"),
    ("is_prime", "n", "checks whether a number is prime"),
    ("primes_below", "n", "returns all prime numbers below n using the sieve of Eratosthenes"),
    ("factorial", "n", "computes n factorial iteratively"),
    ("gcd", "a, b", "computes the greatest common divisor of two integers"),
    ("flatten", "nested", "flattens an arbitrarily nested list"),
    ("chunk", "items, size", "splits a list into chunks of a given size"),
    ("dedupe", "items", "removes duplicates from a list while keeping the original order"),
    ("word_count", "text", "returns a dictionary mapping each word to how often it occurs"),
    ("merge_sorted", "a, b", "merges two sorted lists into one sorted list"),
    ("binary_search", "items, target", "returns the index of target in a sorted list, or -1"),
    ("bubble_sort", "items", "sorts a list with bubble sort"),
    ("quick_sort", "items", "sorts a list with quicksort"),
    ("merge_sort", "items", "sorts a list with merge sort"),
    ("anagrams", "a, b", "checks whether two strings are anagrams of each other"),
    ("capitalize_words", "s", "capitalizes the first letter of every word"),
    ("celsius_to_fahrenheit", "c", "converts a temperature from Celsius to Fahrenheit"),
    ("second_largest", "numbers", "returns the second largest distinct number in a list"),
    ("running_sum", "numbers", "returns the running totals of a list of numbers"),
    ("transpose", "matrix", "transposes a matrix given as a list of lists"),
    ("matrix_multiply", "a, b", "multiplies two matrices given as lists of lists"),
    ("is_balanced", "s", "checks whether the brackets (), [] and {} in a string are balanced"),
    ("roman_to_int", "s", "converts a Roman numeral to an integer"),
    ("int_to_roman", "n", "converts an integer to a Roman numeral"),
    ("caesar_cipher", "text, shift", "encrypts text with a Caesar cipher"),
    ("most_common", "items", "returns the most common element of a list"),
    ("rotate_list", "items, k", "rotates a list to the right by k positions"),
    ("sum_digits", "n", "returns the sum of the digits of an integer"),
    ("is_leap_year", "year", "checks whether a year is a leap year"),
    ("median", "numbers", "returns the median of a list of numbers"),
    ("mean_and_std", "numbers", "returns the mean and standard deviation of a list of numbers"),
    ("longest_common_prefix", "words", "returns the longest common prefix of a list of strings"),
    ("two_sum", "numbers, target", "returns the indices of two numbers that add up to target"),
    ("valid_email", "address", "checks with a regular expression whether a string looks like an email address"),
    ("read_csv_column", "path, column", "reads a CSV file and returns the values of one column"),
    ("count_lines", "path", "counts the non-empty lines in a text file"),
    ("to_snake_case", "name", "converts a camelCase name to snake_case"),
    ("parse_query", "url", "parses the query string of a URL into a dictionary"),
    ("max_subarray", "numbers", "returns the largest sum of a contiguous sub-list (Kadane's algorithm)"),
    ("levenshtein", "a, b", "computes the edit distance between two strings"),
    ("pascal_triangle", "n", "returns the first n rows of Pascal's triangle"),
    ("hex_to_rgb", "color", "converts a hex colour string like '#ff8800' to an (r, g, b) tuple"),
    ("group_by_length", "words", "groups words into a dictionary keyed by their length"),
    ("find_missing", "numbers", "finds the missing number in a list containing 1 to n with one missing"),
    ("power_set", "items", "returns all subsets of a list"),
    ("permutations", "items", "returns all permutations of a list without using itertools"),
]

CODE_STYLES = [
    "Write a Python function `{name}({args})` that {desc}.",
    'Complete the following Python function.\n\n```python\ndef {name}({args}):\n    """Return ... : {desc}."""\n```',
    "Write a Python function that {desc}, and show an example of calling it.",
    "Implement a function in JavaScript that {desc}.",
    "Explain how to write a program that {desc}, then give the code in Python.",
]


def chatterbot_dialogs(wheel: Path):
    """Every English dialog of the chatterbot wheel (a list of lines each), read in place."""
    import yaml

    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if name.startswith("chatterbot_corpus/data/english/") and name.endswith(".yml"):
                yield from (yaml.safe_load(z.read(name)) or {}).get("conversations") or []


def news_paragraphs(wheel: Path) -> list[str]:
    """The Lee news paragraphs of gensim's test data (40 words or more), read in place."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read("gensim/test/test_data/lee_background.cor").decode("utf-8", "replace")
    return [p.strip() for p in text.splitlines() if len(p.split()) >= 40]


def chatterbot_prompts(wheel: Path) -> list[str]:
    """Opening lines of the English chatterbot dialogs (questions only, duplicates removed)."""
    out = [
        conv[0].strip()
        for conv in chatterbot_dialogs(wheel)
        if conv and isinstance(conv[0], str) and len(conv[0].split()) >= 3
    ]
    return list(dict.fromkeys(out))


def _wrapped(paragraphs: list[str]) -> list[str]:
    """The news paragraphs, each wrapped in one instruction template."""
    return [NEWS_TEMPLATES[i % len(NEWS_TEMPLATES)].format(t=p) for i, p in enumerate(paragraphs)]


def build_prompts(
    out: Path,
    chatterbot: Path | None,
    gensim: Path | None,
    n_math: int = 600,
    seed: int = 0,
    user_tasks: bool = False,
) -> int:
    """Write the prompt file (atomically); returns the number of prompts. ``user_tasks``: also the prompts of
    ``user_tasks.py`` (questions, summaries and translations over the wheels' text, chats of several turns)."""
    from ..paths import atomic_write_bytes

    r = random.Random(seed)
    rows: list[tuple[str, str, list[str]]] = []
    for path in (chatterbot, gensim):
        if path is not None:
            if not Path(path).is_file():
                raise UserError(f"wheel not found: {path}")
            try:
                with zipfile.ZipFile(path) as z:
                    z.namelist()
            except zipfile.BadZipFile as e:
                raise UserError(f"{path}: not the expected wheel ({e})") from None
    try:  # (each wheel read once: the user tasks reuse its openers and paragraphs)
        openers = chatterbot_prompts(Path(chatterbot)) if chatterbot is not None else []
        paragraphs = news_paragraphs(Path(gensim)) if gensim is not None else []
        rows += [("chat", "instruction", [t]) for t in openers]
        rows += [("news", "instruction", [t]) for t in _wrapped(paragraphs)]
        if user_tasks:
            foreign = ut.foreign_lines(Path(chatterbot)) if chatterbot is not None else {}
            rows += _user_task_rows(openers, paragraphs, foreign, r)
    except KeyError as e:
        raise UserError(f"not the expected wheel (chatterbot-corpus, gensim): {e.args[0] if e.args else e}") from None
    rows += [("math", "math_reasoning", [_math_problem(r)]) for _ in range(n_math)]
    rows += [
        ("code", "coding", [style.format(name=name, args=args, desc=desc)])
        for name, args, desc in CODE_TASKS
        for style in CODE_STYLES
    ]
    r.shuffle(rows)
    lines = [
        json.dumps({"id": f"{src}-{i:05d}", "category": cat, "turns": turns, "source": src})
        for i, (src, cat, turns) in enumerate(rows)
    ]
    atomic_write_bytes(Path(out), ("\n".join(lines) + "\n").encode())
    return len(lines)


def _user_task_rows(openers: list[str], paragraphs: list[str], foreign: dict[str, list[str]], r: random.Random):
    """``user_tasks.py``'s prompts from the wheels' chat openers, news paragraphs and other languages' lines."""
    openers = r.sample(openers, min(len(openers), 400))  # chats open with a question or a passage task
    openers += [r.choice(ut.SUMMARIES).format(p=p) for p in paragraphs[::3]]
    return ut.passage_tasks(paragraphs, r) + ut.translation_tasks(paragraphs, foreign, r) + ut.chat_tasks(openers, r)
