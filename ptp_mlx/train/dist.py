"""Data-parallel training with MLX's own distributed layer (``mx.distributed``, started by ``mlx.launch``).

Every process draws the whole step's sequences and windows from the same ``(seed, step)`` stream, keeps its own
slice of them (sequence ``i`` goes to process ``i % size``), and computes its slice's share of the step's
gradient (its weighted loss sum over the whole step's weight). ``all_sum`` then gives every process the same
gradient a single process computes for the same global batch, up to float summation order, so every process
applies the same update and the adapters stay identical. Process 0 alone writes checkpoints, logs and adapters.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map


class Group:
    """This process's place in the job: ``rank`` of ``size`` (1 and 0 without ``mlx.launch``)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    @property
    def main(self) -> bool:
        """Whether this process writes files and prints progress (process 0)."""
        return self.rank == 0

    def mine(self, items: list) -> list:
        """This process's slice of a step's sequences."""
        return items[self.rank :: self.size] if self.size > 1 else items

    def sum(self, tree):
        """The element-wise sum of ``tree`` (arrays) over every process."""
        if self.size == 1:
            return tree
        return tree_map(lambda x: mx.distributed.all_sum(x, group=self.group), tree)

    def agree(self, value: int) -> int:
        """Process 0's ``value`` on every process (e.g. a step count sized from process 0's clock)."""
        if self.size == 1:
            return value
        x = mx.array(value if self.main else 0, dtype=mx.int32)
        return int(mx.distributed.all_sum(x, group=self.group).item())


def init() -> Group:
    """The job's group when launched by ``mlx.launch`` (more than one process), else a group of one."""
    if not mx.distributed.is_available():
        return Group()
    g = mx.distributed.init()
    return Group(g) if g.size() > 1 else Group()
