"""The run folder of ``ptp-train auto`` (``auto.py``): where each phase's inputs, outputs and "finished" marker
live, one process per folder, and the file-level care that makes every phase resumable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..cli_common import UserError


class RunFolder:
    """The run folder: inputs, outputs and one marker per finished phase (written atomically)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def __getattr__(self, name: str) -> Path:
        files = {"prompts": "prompts.jsonl", "teacher": "teacher.jsonl", "val": "val.jsonl", "plan": "plan.json"}
        if name in files:
            return self.root / files[name]
        if name in ("train", "adapter", "probe_dir"):
            return self.root / name
        raise AttributeError(name)

    def done(self, phase: str) -> dict | None:
        f = self.root / "phases" / f"{phase}.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def mark(self, phase: str, info: dict) -> None:
        from ..paths import atomic_write_bytes

        atomic_write_bytes(self.root / "phases" / f"{phase}.json", (json.dumps(info, indent=1) + "\n").encode())


def free_bytes(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def trim_partial_line(path: Path) -> None:
    """Cut an interrupted writer's unfinished last line, so appending resumes on a clean line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def lock_run(root: Path) -> None:
    """One ``auto`` per run folder: a second one would write the same files (the lock goes with the process)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    f = open(root / ".lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise UserError(f"another ptp-train auto is running in {root}") from None
    _LOCKS.append(f)  # held until the run ends


_LOCKS: list = []


def release_runs() -> None:
    """Let go of every run folder this process locked."""
    while _LOCKS:
        _LOCKS.pop().close()
