"""The ``ptp-serve`` command itself: it starts, serves and stops on Ctrl-C; bad flags get one line and exit 2."""

import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from ptp_mlx.serve.cli import main as serve_main
from ptp_mlx.testing.serving import wait_for


def test_command_serves_and_stops_on_ctrl_c(serve_model_dir, serve_adapter_dir, tmp_path):
    env = {**os.environ, "PTP_MLX_HOME": str(tmp_path / "home")}
    cmd = [
        sys.executable,
        "-m",
        "ptp_mlx.serve.cli",
        "--model",
        str(serve_model_dir),
        "--adapter",
        str(serve_adapter_dir),
    ]
    p = subprocess.Popen(cmd + ["--port", "0", "--max-tokens", "8"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"serving model \(ptp\) on (http://\S+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no 'serving' line"
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        wait_for(lambda: _up(client), 30)
        r = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 8
        # Ctrl-C with a stream open: the stream ends at once with a "shutting down" error event and [DONE] (it ran
        # on until uvicorn's graceful timeout cancelled it, a traceback on stderr), and the server exits 0.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000, "stream": True}
        body["logit_bias"] = {"2": -100}  # (no end-of-answer token: the answer runs until stopped)
        with httpx.Client(timeout=30) as http, http.stream("POST", url + "/chat/completions", json=body) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            p.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"shutting_down"' in rest[-2], rest[-3:]
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert "Traceback" not in err and "Exception in ASGI" not in err, err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _up(client) -> bool:
    try:
        return bool(client.models.list().data)
    except Exception:
        return False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "99999"], "--port must be between"),
        (["--max-queue", "0"], "--max-queue must be at least 1"),
        (["--temp", "-1"], "temperature must be >= 0"),
        (["--port", "x"], "invalid int value"),
        (["--port", "{busy}"], "cannot listen on 127.0.0.1:"),
        (["--adapter", "none", "--num-draft-tokens", "2"], "--num-draft-tokens needs an adapter"),
    ],
)
def test_bad_flags_one_line_exit_2(serve_model_dir, capsys, argv, message):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    argv = [a.format(busy=busy.getsockname()[1]) for a in argv]
    try:
        rc = serve_main(["--model", str(serve_model_dir), *argv])
    except SystemExit as e:
        rc = e.code
    finally:
        busy.close()
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
