"""The model floor (imports only ``ptp_mlx``'s leaves; ``tests/test_imports.py``).

- ``ptp.py``: the PTP model, a stock mlx-lm model plus a gated LoRA and a u-embedding.
- ``shape.py``: one description of a pass's rows (``CallShape``: token rows, windows, masks, positions) and the pass
  kinds the patched modules read (``PassKind``: ``CallPlan``, ``FixedPlan``; training's ``BatchPlan``).
- ``layers.py``: the stock model's modules patched in place; ``fused.py``: fused projections and their LoRA
  (``FusedGroup``, or ``FusedLoRA`` on a quantized base; one ``INPUT_GROUPS``).
- ``kv.py``: the one owner of the K/V state (buffers, an offset, verbs); ``stock_cache.py``: the same verbs over
  mlx-lm's caches for models PTP does not patch.
- ``rope.py``, ``cpu_math.py``: RoPE and attention/SwiGLU where MLX's CPU backend has no fast kernel.
"""
