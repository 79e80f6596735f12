import os

import pytest

import ptp_mlx  # noqa: F401  (sets up the BLAS before mlx is imported)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from ptp_mlx.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """(model, tokenizer) of the tiny random Llama, loaded with mlx_lm.load."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model (SmolLM2-135M-Instruct), fetched and converted once into the cache."""
    if os.environ.get("PTP_MLX_SKIP_SLOW"):
        pytest.skip("PTP_MLX_SKIP_SLOW is set")
    from ptp_mlx.models import ensure_default_model

    return ensure_default_model()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch, request):
    # Tests that do not use the real default model get their own cache root, so nothing leaks.
    if "default_model_dir" not in request.fixturenames and not os.environ.get("PTP_MLX_HOME"):
        monkeypatch.setenv("PTP_MLX_HOME", str(tmp_path / "home"))
    # User data (saved chats) always: a test never reads or writes the user's own, even with PTP_MLX_HOME set.
    monkeypatch.setenv("PTP_MLX_DATA", str(tmp_path / "data"))


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory, tiny):
    """A random PTP adapter (rank 4, window 4) for the tiny model."""
    from ptp_mlx.adapter import make_config, save_adapter
    from ptp_mlx.model.ptp import PTPAdapter
    from ptp_mlx.testing import randomize_adapter

    model, _ = tiny
    ad = PTPAdapter(model, 4, 1.0, "binary")
    randomize_adapter(ad)
    out = tmp_path_factory.mktemp("adapter") / "ad"
    save_adapter(ad, make_config(model, ad, 4, 1.0, window=4), out)
    return out


# The decoding tests' models (ptp_mlx/testing/decoding.py), one set per test module.
@pytest.fixture(scope="module")
def varied(tiny_model_dir):
    """(model, tokenizer): the tiny Llama with re-randomised, larger weights (a private copy)."""
    import mlx_lm

    from ptp_mlx.testing.decoding import varied_model

    model, tok = mlx_lm.load(str(tiny_model_dir))
    return varied_model(model), tok


@pytest.fixture(scope="module")
def pm_sticky(varied):
    """An adapter whose drafts are right exactly when the model emits its most frequent token."""
    from ptp_mlx.testing.decoding import sticky_model

    return sticky_model(*varied)


@pytest.fixture(scope="module")
def pm_random(varied):
    """A plainly random adapter (linear-interpolation u-embedding, a reserved greedy u)."""
    from ptp_mlx.testing.decoding import random_model

    return random_model(varied[0])


# The bench tests' prompt file (tests/test_bench.py, tests/test_bench_cli.py): two categories, one two-turn prompt.
BENCH_PROMPTS = [
    {"question_id": "a-1", "category": "alpha", "turns": ["Say hello."]},
    {"question_id": "b-1", "category": "beta", "turns": ["Count to three.", "Now backwards."]},
    {"question_id": "a-2", "category": "alpha", "turns": ["Name a colour."]},
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    import json

    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in BENCH_PROMPTS))
    return p


# The server tests' model, adapter and live server (ptp_mlx/testing/serving.py), one per test module.
@pytest.fixture(scope="module")
def serve_model_dir(tmp_path_factory):
    from ptp_mlx.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("serve") / "model", varied=True, seed=3)


@pytest.fixture(scope="module")
def serve_adapter_dir(serve_model_dir, tmp_path_factory):
    """A randomized PTP adapter: drafts are verified, some accepted."""
    from ptp_mlx.testing import save_random_adapter

    return save_random_adapter(serve_model_dir, tmp_path_factory.mktemp("serve") / "adapter")


@pytest.fixture(scope="module")
def server(serve_model_dir, serve_adapter_dir, tmp_path_factory):
    from ptp_mlx.engine import Engine
    from ptp_mlx.serve.app import create_app
    from ptp_mlx.serve.schema import Defaults
    from ptp_mlx.serve.worker import EngineWorker
    from ptp_mlx.testing.serving import DRAFTS, MAX_BODY, MAX_QUEUE, MODEL_ID, ThreadServer

    with pytest.MonkeyPatch.context() as mp:  # the cost curve is measured into a scratch cache root
        mp.setenv("PTP_MLX_HOME", str(tmp_path_factory.mktemp("home")))
        load = lambda: Engine.load(str(serve_model_dir), str(serve_adapter_dir))  # noqa: E731
        worker = EngineWorker(load, max_queue=MAX_QUEUE, num_draft_tokens=DRAFTS)
        worker.start()
    srv = ThreadServer(create_app(worker, MODEL_ID, Defaults(max_tokens=32), MAX_BODY), worker)
    yield srv
    srv.stop()


@pytest.fixture
def anyio_backend():
    """The chat tests run on asyncio (``pytest.mark.anyio``)."""
    return "asyncio"
