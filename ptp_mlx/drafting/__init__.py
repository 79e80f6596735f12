"""Drafting: what each PTP call verifies and drafts (docs/method.md, section 5).

One protocol, one file per idea:

- ``protocol``: ``DraftPlan`` (the rows of one call, frozen), ``CallResult`` (what a call settled),
  ``DraftSession`` and the abstract ``Drafter`` (``begin``, then ``plan`` / ``update`` per call, ``emitted`` per
  block, ``ready``);
- ``budget``: the ``BudgetPolicy`` interface (``rows_for``) and its two implementations, the adaptive ``Budget``
  and the ``FixedBudget`` of ``--num-draft-tokens``;
- ``cost``: the cost curve of a call by rows, and the probe that measures it on this machine;
- ``chain``, ``tree``: the adapter's own chain of drafts, and the same with the runner-up of the first draft as a
  sibling strand;
- ``lookup``: prompt-lookup chains (``LookupProposer``), a peer that offers drafts without knowing the chain;
- ``policy``: ``DraftPolicy`` picks between the peers' offers with the budget they share, and ``make_drafter``
  composes the default drafter from one ``DraftingConfig``.

A new drafter is one class implementing ``Drafter`` (tests define one in a few lines).
"""
