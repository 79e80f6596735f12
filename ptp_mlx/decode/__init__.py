"""The decode floor: plain steps and PTP calls over the model (imports model, drafting and leaves only).

- ``ar.py``: the prefill and the pipelined plain step loop (plain decoding and the PTP loop's bursts).
- ``ptp.py``: the PTP loop (``ptp_calls``), beside ``ar.py``'s: both take a ``DecodeSession`` and yield a block and
  a ``CallRecord`` per call.
- ``pipeline.py``: the call queue (``CallQueue``: the calls in flight and their offsets, when to build ahead);
  ``ahead.py``: the next call built for every outcome of this one while it computes (chained calls).
- ``call.py``: one PTP call, built and finished (verify, accept, trim); ``shape.py``: its spec (``CallSpec``: the
  rows, ``model/shape.py: CallShape``, the settings and the rule), its inputs (``CallInputs``) and outputs.
- ``fixed.py``: the fixed-shape call as a pure function of arrays, compiled per spec and attention bucket
  (``CompileBank.call(state, spec, inputs)``).
- ``accept.py``: the acceptance rules (exact by default; opt-in lenient ones).
- ``session.py``: what stays constant over one answer's calls.
- ``probe.py``: the cost probe (the prior of the costs ``drafting/learn.py`` learns).
"""
