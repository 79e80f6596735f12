"""Per kind, the answers each rule lost and gained against exact decoding, from a ``ptp-bench --tasks --json`` file.

usage: python docs/results/tasks/turns/kinds.py FILE.json [FILE.json ...]
"""

import json
import sys
from collections import Counter


def main(paths: list[str]) -> None:
    for path in paths:
        doc = json.load(open(path))["tasks"]
        rules, items = [r["rule"] for r in doc["rules"]], doc["items"]
        print(f"{path}: {doc['settings']}")
        for j, rule in enumerate(rules[1:], start=1):
            lost = Counter(it["kind"] for it in items if it["right"][0] and not it["right"][j])
            gained = Counter(it["kind"] for it in items if not it["right"][0] and it["right"][j])
            print(f"  {rule}: lost {dict(sorted(lost.items()))} gained {dict(sorted(gained.items()))}")


if __name__ == "__main__":
    main(sys.argv[1:])
