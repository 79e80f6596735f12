"""The typed contents of ``adapter_config.json`` (docs/conventions.md, "Files"): what decoding needs, read and
checked once at load. Apart from ``adapter`` (the folder's I/O, which builds adapters) so that the model code can
use the config without importing the loader that imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

U_EMBEDDING_KINDS = ("binary", "linear_interpolation")


@dataclass(frozen=True)
class AdapterConfig:
    """What decoding needs from ``adapter_config.json``, read and checked once at load.

    ``raw`` keeps the whole file (recipe, validation, notes) for display and for writing it back.
    """

    rank: int = 16
    scale: float = 2.0
    u_embedding: str = "binary"
    window: int = 8  # auxiliaries per window (K): drafts per branch are at most window - 1
    target_modules: tuple[str, ...] | None = None  # None: every projection of the block
    layers: tuple[int, ...] | None = None  # None: every block
    greedy_u: float | None = None  # reserved u that drafts the argmax (greedy decoding)
    cdf_order: str = "id"  # the sampler's CDF order the adapter was trained against (sampler.CDF_ORDERS)
    acceptance_histogram: tuple[float, ...] | None = None
    acceptance_histograms: dict[str, tuple[float, ...]] = field(default_factory=dict)  # "greedy" / "sampled"
    base_model: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict, strict: bool = False) -> AdapterConfig:
        """Typed config; ``ValueError`` naming the first bad or (``strict``: a file's) missing field."""
        if strict:
            missing = [k for k in ("rank", "scale", "u_embedding") if k not in d]
            if missing:
                raise ValueError(f"missing field {missing[0]!r}")

        def hist(h):
            return tuple(float(x) for x in h) if h else None

        try:
            cfg = cls(
                rank=int(d.get("rank", 16)),
                scale=float(d.get("scale", 2.0)),
                u_embedding=str(d.get("u_embedding", "binary")),
                window=int(d.get("window", 8)),
                target_modules=tuple(d["target_modules"]) if d.get("target_modules") else None,
                layers=tuple(int(i) for i in d["layers"]) if d.get("layers") is not None else None,
                greedy_u=float(d["greedy_u"]) if d.get("greedy_u") is not None else None,
                cdf_order=str(d.get("cdf_order") or "id"),
                acceptance_histogram=hist(d.get("acceptance_histogram")),
                acceptance_histograms={k: hist(v) for k, v in (d.get("acceptance_histograms") or {}).items() if v},
                base_model=dict(d.get("base_model") or {}),
                raw=dict(d),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad field: {e}") from None
        if cfg.u_embedding not in U_EMBEDDING_KINDS:
            raise ValueError(f"unknown u-embedding kind {cfg.u_embedding!r} (known: {', '.join(U_EMBEDDING_KINDS)})")
        if cfg.cdf_order not in ("id", "prob"):
            raise ValueError(f"unknown CDF order {cfg.cdf_order!r} (known: id, prob)")
        if cfg.rank < 0 or cfg.window < 2:  # rank 0: no LoRA (a model trained from scratch for PTP)
            raise ValueError(f"rank must be >= 0 and window >= 2 (got {cfg.rank}, {cfg.window})")
        return cfg
