"""Drafting: what each PTP call verifies and drafts (docs/method.md, section 5).

One protocol, one file per idea:

- ``protocol``: ``Plan`` (the rows of one call), ``CallResult`` (what a call settled), ``DraftSession`` and the
  ``Drafter`` protocol (``begin``, then ``plan`` / ``update`` per call, ``emitted`` per block, ``ready``);
- ``budget``: the ``BudgetPolicy`` interface and its two implementations, the adaptive ``Budget`` and the
  ``FixedBudget`` of ``--num-draft-tokens``;
- ``cost``: the cost curve of a call by rows, and the probe that measures it on this machine;
- ``chain``, ``tree``, ``lookup``: the adapter's own chain of drafts, the same with the runner-up of the first
  draft as a sibling strand, and prompt-lookup chains.

A new drafter is one class implementing ``Drafter`` (tests define one in a few lines).
"""
