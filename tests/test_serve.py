"""``ptp-serve`` (issue 15): the real server (uvicorn on 127.0.0.1, a free port) on a tiny model with a PTP
adapter, talked to with the official ``openai`` client and raw HTTP. Chat and completions, streamed and not, give
the text ``ptp-generate`` prints for the same seed and settings; usage carries the token counts and PTP's figures;
stop strings cut the text (also across streamed blocks); every bad input gets its status and an OpenAI error body;
lenient acceptance is opt-in and answered with its label. Queues and disconnects: ``test_serve_worker.py``; the
command: ``test_serve_cli.py``."""

import json

import httpx
import pytest
from openai import NotFoundError

from ptp_mlx.serve.stops import StopMatcher
from ptp_mlx.testing.serving import MAX_BODY, MODEL_ID, ptp_generate, stream_text


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert server.client().models.retrieve(MODEL_ID).id == MODEL_ID


SETTINGS = {  # name -> (request fields, ptp-generate flags, system prompt)
    "greedy": ({}, [], None),
    "sampled": (
        {"temperature": 1.0, "top_p": 0.95, "seed": 5, "extra_body": {"top_k": 40}},
        ["--temp", 1.0, "--top-p", 0.95, "--top-k", 40, "--seed", 5],
        "be brief",
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_chat_is_ptp_generate_streamed_or_not(server, serve_model_dir, serve_adapter_dir, capsys, setting):
    kw, flags, system = SETTINGS[setting]
    prompt = "The quick brown fox"
    if system:
        flags = [*flags, "--system", system]
    want = ptp_generate(capsys, serve_model_dir, serve_adapter_dir, prompt, "--max-tokens", 40, *flags)
    assert want.strip()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    client = server.client()
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40, **kw)
    assert r.object == "chat.completion" and r.model == MODEL_ID
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    engine_ids = server.worker.engine.encode(messages)
    assert u.prompt_tokens == len(engine_ids) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 40
    ptp = u.model_extra["ptp"]
    assert ptp["mode"] == "ptp" and 1 <= ptp["calls"] <= u.completion_tokens + 1 and ptp["tokens_per_call"] >= 1
    assert 0 <= ptp["drafts_accepted"] <= ptp["drafts_proposed"] and ptp["drafts_proposed"] >= ptp["calls"] - 1
    assert ptp["drafts_accepted"] == sum(ptp["accepted_by_source"].values())
    # every call decided its accepted drafts and one token more, each emitted or the end of the answer (drafts that
    # stood past the end are not counted)
    ended = r.choices[0].finish_reason == "stop"
    assert ptp["calls"] + ptp["drafts_accepted"] == u.completion_tokens + ended
    assert ptp["accept"] == "exact"  # exact unless the client opts out
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, reason, chunks = stream_text(stream)
    assert text == want and reason == r.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == u.completion_tokens
    assert last.usage.prompt_tokens == u.prompt_tokens
    # The same prompt again continues from the prompt cache: all but its last token come from it.
    assert last.usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_completions_are_ptp_generate_without_template(server, serve_model_dir, serve_adapter_dir, capsys):
    want = ptp_generate(
        capsys, serve_model_dir, serve_adapter_dir, "count: 1 2 3", "--no-chat", "--max-tokens", 24, "--seed", 2
    )
    client = server.client()
    r = client.completions.create(model=MODEL_ID, prompt="count: 1 2 3", max_tokens=24, seed=2)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.usage.prompt_tokens == len("count: 1 2 3")  # the byte tokenizer: one token per byte
    chunks = list(client.completions.create(model=MODEL_ID, prompt="count: 1 2 3", max_tokens=24, seed=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    ids = list(server.worker.engine.tokenizer.encode("count: 1 2 3"))
    assert client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=24, seed=2).choices[0].text == want


def test_completions_keep_the_leading_space(server):
    # mlx-lm's detokenizer trims an answer's leading space (right for a chat answer and for ptp-generate, which
    # prints as mlx_lm.generate does); a completion is text that continues the prompt, as OpenAI's, space and all.
    space = server.worker.engine.tokenizer.encode(" a")[0]
    client = server.client()
    for n in (1, 3):
        kw = {"model": MODEL_ID, "prompt": "count: 1 2 3", "max_tokens": n, "logit_bias": {str(space): 100}}
        assert client.completions.create(**kw).choices[0].text == " " * n
        assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == " " * n
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logit_bias={str(space): 100}
    )
    assert r.choices[0].message.content == "  "  # a chat answer as mlx-lm shows it


def test_conversation_continues_from_the_prompt_cache(server):
    """A follow-up turn prefills only its new tokens, and the answer is the one a fresh cache gives."""
    client = server.client()
    m = [{"role": "user", "content": "a conversation starts here"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    m = m + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and goes on"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    server.worker.pool.entries.clear()  # the worker is idle: no cache left to reuse
    fresh = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=16)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == second.choices[0].message.content


def test_defaults_follow_the_server_flags(server):
    """Without temperature, seed and max_tokens the request gets the server's flags: greedy, seed 0, 32 tokens."""
    client = server.client()
    m = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=m)
    same = client.chat.completions.create(model=MODEL_ID, messages=m, temperature=0, seed=0, max_tokens=32)
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.completion_tokens <= 32


def test_stop_strings_cut_the_text(server):
    client = server.client()
    m = [{"role": "user", "content": "hello world"}]
    full = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60).choices[0].message.content
    assert len(full) > 20
    stop = full[12:15]  # three characters: a stop string that spans blocks and tokens
    want = full[: full.find(stop)]
    r = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    text, reason, _ = stream_text(
        client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop=stop, stream=True)
    )
    assert text == want and reason == "stop"
    # A stop string that never occurs changes nothing.
    r = client.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=60, stop="\x00never")
    assert r.choices[0].message.content == full


def test_stop_matcher_any_chunking():
    text = "abcabxabcd"
    for stops, want in ((["abx"], "abc"), (["cd", "bca"], "a"), (["zz"], text), (["d"], "abcabxabc")):
        for size in range(1, len(text) + 1):
            m = StopMatcher(stops)
            out = "".join(m.feed(text[i : i + size]) for i in range(0, len(text), size)) + m.flush()
            assert out == want, (stops, size)


def test_logprobs_only_for_tokens_whose_text_was_sent():
    # A token's entry waits while its text may begin a stop string; past the stop it is never sent (it was, before:
    # "\n" of a cut "\n\n" came with "." in the same block), and text still held at the end is sent with its entries.
    from types import SimpleNamespace

    from ptp_mlx.logits import TokenLogprob
    from ptp_mlx.serve.tools_out import AnswerText

    pieces = ["Par", "is", ".", "\n", "\n", "The", " end"]
    tok = SimpleNamespace(detokenizer=None, decode=lambda ids: pieces[ids[0]])
    for stops, text, count in ((["\n\n"], "Paris.", 3), ([".\nX"], "".join(pieces), 7), (["is."], "Par", 1)):
        for size in range(1, len(pieces) + 1):
            out = AnswerText(tok, StopMatcher(stops), None)
            got, entries = "", []
            for i in range(0, len(pieces), size):
                ids = range(i, min(i + size, len(pieces)))
                step = SimpleNamespace(
                    text="".join(pieces[t] for t in ids), logprobs=[TokenLogprob(t, -1.0) for t in ids]
                )
                t, e = out.feed(step)
                got, entries = got + t, entries + (e or [])
                if out.stops.stopped:
                    break
            tail, e, _ = out.finish()
            got, entries = got + tail, entries + (e or [])
            assert got == text and [e["token"] for e in entries] == pieces[:count], (stops, size)


def test_a_request_without_seed_samples_anew_unless_the_server_has_one():
    # ptp-serve without --seed: each request that names no seed draws its own (a front end's "regenerate" used to get
    # the same sampled answer every time); a request's own seed, or the server's --seed, makes it reproducible.
    from ptp_mlx.sampler import SamplingSettings
    from ptp_mlx.serve.cli import build_parser
    from ptp_mlx.serve.schema import Defaults, parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.8}
    fresh = Defaults(SamplingSettings(0.0, seed=0), fresh_seeds=True)
    seeds = {parse_chat(dict(body), MODEL_ID, fresh).sampling.seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= x < 2**63 for x in seeds)
    assert parse_chat({**body, "seed": 7}, MODEL_ID, fresh).sampling.seed == 7
    fixed = Defaults(SamplingSettings(0.0, seed=3))
    assert parse_chat(dict(body), MODEL_ID, fixed).sampling.seed == 3
    assert build_parser().parse_args([]).seed is None and build_parser().parse_args(["--seed", "5"]).seed == 5


def test_bad_inputs_get_openai_errors(server):
    url = server.url + "/v1/chat/completions"
    ok_msg = [{"role": "user", "content": "hi"}]
    cases = [
        # (body bytes or JSON object, status, param, code)
        (b"{not json", 400, None, "invalid_json"),
        (b"", 400, None, "invalid_json"),
        ([1, 2], 400, None, "invalid_type"),
        ({"model": MODEL_ID}, 400, "messages", "invalid_type"),
        ({"messages": "hi"}, 400, "messages", "invalid_type"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "invalid_type"),
        ({"messages": ok_msg, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"messages": ok_msg, "temperature": -1}, 400, "temperature", "invalid_value"),
        ({"messages": ok_msg, "top_p": 0}, 400, "top_p", "invalid_value"),
        ({"messages": ok_msg, "top_k": 1.5}, 400, "top_k", "invalid_type"),
        ({"messages": ok_msg, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"messages": ok_msg, "max_tokens": True}, 400, "max_tokens", "invalid_type"),
        ({"messages": ok_msg, "seed": -3}, 400, "seed", "invalid_value"),
        ({"messages": ok_msg, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"messages": ok_msg, "stop": 7}, 400, "stop", "invalid_type"),
        ({"messages": ok_msg, "stream": "yes"}, 400, "stream", "invalid_type"),
        ({"messages": ok_msg, "n": 2}, 400, "n", "invalid_value"),
        ({"messages": ok_msg, "accept": "sloppy"}, 400, "accept", "invalid_value"),
        ({"messages": ok_msg, "accept": 3}, 400, "accept", "invalid_type"),
        ({"messages": ok_msg, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages", "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}, 413, None, "request_too_large"),
    ]
    with httpx.Client(timeout=30) as http:
        for body, status, param, code in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(url, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body if len(content) < 200 else content[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert err["param"] == param and err["code"] == code, (content[:80], err)
            assert err["type"] == "invalid_request_error"
        for body, param in (
            ({"prompt": 5}, "prompt"),
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": [1, 999]}, "prompt"),
        ):
            r = http.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post(server.url + "/v1/completions", json={"prompt": "x" * 600})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.get(server.url + "/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert http.get(url).status_code == 405 and "error" in http.get(url).json()
    with pytest.raises(NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-4o", messages=ok_msg)
    assert e.value.body["code"] == "model_not_found"
    # Nothing broke: the server still answers.
    assert server.client().chat.completions.create(model=MODEL_ID, messages=ok_msg, max_tokens=4).choices


def test_lenient_acceptance_is_opt_in_and_answered_with_its_label(server):
    """The ``accept`` extension: a lenient rule is used only when asked for, and the response names it; its
    strictest setting answers what exact decoding answers."""
    client = server.client()
    msg = [{"role": "user", "content": "hello there"}]
    exact = client.chat.completions.create(model=MODEL_ID, messages=msg, max_tokens=24)
    strict = client.chat.completions.create(
        model=MODEL_ID, messages=msg, max_tokens=24, extra_body={"accept": "threshold:tau=1.5"}
    )
    assert strict.choices[0].message.content == exact.choices[0].message.content
    assert strict.usage.model_extra["ptp"]["accept"] == "lenient threshold tau=1.5"
    loose = client.chat.completions.create(
        model=MODEL_ID, messages=msg, max_tokens=24, extra_body={"accept": "threshold:0"}
    )
    ptp = loose.usage.model_extra["ptp"]
    assert ptp["accept"] == "lenient threshold tau=0" and ptp["drafts_accepted"] == ptp["drafts_proposed"] > 0


def test_lenient_follow_ups_know_where_their_turn_starts(server, monkeypatch):
    """A lenient chat request's job carries where its last user message starts (``Engine.turn_start``: copies
    of an earlier answer are then verified exactly); an exact one does not need it."""
    seen, submit = [], server.worker.submit
    monkeypatch.setattr(server.worker, "submit", lambda job: seen.append(job.turn_start) or submit(job))
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "one two"}]
    chat.append({"role": "user", "content": "three"})
    for accept in ("threshold:0", "exact"):
        server.client().chat.completions.create(
            model=MODEL_ID, messages=chat, max_tokens=4, extra_body={"accept": accept}
        )
    eng = server.worker.engine
    assert seen == [eng.turn_start(chat, eng.encode(chat)), 0] and seen[0] > 0
