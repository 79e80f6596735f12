"""List the exactness cases (collected test items whose test compares with plain decoding) of a checkout."""

import ast
import json
import subprocess
import sys
from pathlib import Path

root = Path(sys.argv[1])
HELPERS = {"assert_same", "ar", "explain_divergence", "decode_ar", "check_lossless"}
exact_fns = set()
for p in (root / "tests").glob("test_*.py"):
    for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test"):
            calls = {
                c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
                for c in ast.walk(n)
                if isinstance(c, ast.Call)
            }
            if (
                calls & HELPERS
                or "lossless" in n.name
                or "exact" in n.name
                or "equals_ar" in n.name
                or "same_tokens" in n.name
            ):
                exact_fns.add(n.name)
out = subprocess.run(
    [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
    cwd=root,
    capture_output=True,
    text=True,
).stdout
items = [line.strip() for line in out.splitlines() if "::" in line]
cases = sorted(i for i in items if i.split("::")[-1].split("[")[0] in exact_fns)
print(json.dumps({"total_items": len(items), "exact_cases": len(cases), "cases": cases}))
