"""Drafting: what each PTP call verifies and drafts (docs/method.md, section 5).

One protocol, one file per idea:

- ``protocol``: ``DraftPlan`` (the rows of one call, frozen, with its token tree's ``Strand``s), ``CallResult`` (what a call settled),
  ``DraftSession`` and the abstract ``Drafter`` (``begin``, then ``plan`` / ``update`` per call, ``emitted`` per
  block, ``ready``);
- ``budget_policy``: the ``BudgetPolicy`` interface (``rows_for``); ``budget``: the adaptive ``Budget``;
  ``fixed_budget``: the ``FixedBudget`` of ``--num-draft-tokens``;
- ``shapes``: the call shapes a budget has used (each a compiled graph), preferred over new ones;
- ``strands``: the side strands peers offer (``StrandOffer``) and which of them a call's token tree verifies;
- ``cost``: the cost curve of a call by rows, and the probe that measures it on this machine;
- ``chain``, ``tree``: the adapter's own chain of drafts, and the same offering the runner-up of every draft as a
  one-token strand;
- ``lookup``: prompt-lookup chains (``LookupProposer``), a peer that offers drafts without knowing the chain;
- ``policy``: ``DraftPolicy`` picks between the peers' offers with the budget they share, and ``make_drafter``
  composes the default drafter from one ``DraftingConfig``.

A new drafter is one class implementing ``Drafter`` (tests define one in a few lines).
"""
