"""One name, one class, across ``ptp_mlx`` (issue 42, item 5): no class name is defined twice in the package,
at module level or nested in a class or a function. Five plans once travelled under one name; they are
``CallPlan``, ``FixedPlan``, ``BatchPlan``, ``TrainingPlan`` and the drafting ``DraftPlan`` now."""

from __future__ import annotations

import ast
from pathlib import Path

import ptp_mlx

ROOT = Path(ptp_mlx.__file__).parent


def classes_defined_twice(sources: dict[str, str]) -> dict[str, list[str]]:
    """``{class name: ["where:line", ...]}`` for every name that more than one class definition in ``sources``
    (``{where: source}``) takes, top-level and nested alike."""
    seen: dict[str, list[str]] = {}
    for where, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(f"{where}:{node.lineno}")
    return {name: places for name, places in seen.items() if len(places) > 1}


def test_the_check_finds_every_class_name_defined_twice():
    planted = {
        "a.py": "class Twice:\n    pass\n\n\nclass Once:\n    pass\n",
        "b.py": "class Twice:\n    pass\n",  # across modules; c.py: nested, in a class and in a function
        "c.py": "class Outer:\n    class Inner:\n        pass\n\n\ndef f():\n    class Inner:\n        pass\n",
        "d.py": "class Outer2:\n    class Nested:\n        pass\n",  # nested, once: fine
    }
    assert classes_defined_twice(planted) == {"Twice": ["a.py:1", "b.py:1"], "Inner": ["c.py:2", "c.py:7"]}
    assert classes_defined_twice({"e.py": "class E:\n    pass\n\n\nE2 = E\n"}) == {}  # an alias is no definition


def test_no_class_name_is_defined_twice():
    sources = {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(ROOT.rglob("*.py"))}
    twice = classes_defined_twice(sources)
    assert not twice, "\n".join(f"class {name} defined at {', '.join(places)}" for name, places in twice.items())
