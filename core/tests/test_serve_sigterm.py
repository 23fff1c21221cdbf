"""``lowlat serve`` as a subprocess: SIGTERM lets a running stream finish, refuses new work, exits 0; Ctrl-C
(SIGINT) stops it the same way."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need lowlat[serve] (httpx, fastapi, uvicorn)")

START_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_drains_and_exits_0(tp, tmp_path):
    """With --tp 2 rank 0 serves and the spawned worker follows its calls."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    proc = subprocess.Popen([sys.executable, "-m", "lowlat.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--max-context-len", "512", "--no-cuda-graph", "--shutdown-grace", "20", "--tp", str(tp),
                             "--served-model-name", "mine", "--chat-template", str(template)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "mine"
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "mine", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 2}).json()
        assert chat["usage"]["prompt_tokens"] == len("[abc]")  # the --chat-template file rendered it
        body = {"model": "mine", "prompt": "drain me", "max_tokens": 400, "stream": True, "ignore_eos": True}
        finish = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line == "data: [DONE]":
                    break
                if line.startswith("data: "):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        assert finish == "length"  # the running request finished within the grace period
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "lowlat serve: stopped" in out and "Traceback" not in out
        # the path that serves (float32 on a CPU: the general path) is printed before the server listens
        assert out.index("lowlat serve: plugin: none (auto: every step on the general path)") \
            < out.index("lowlat serve: mine (LlamaForCausalLM) on http://"), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_sigint_stops_cleanly_and_exits_0():
    """Ctrl-C: the same drained shutdown as SIGTERM, exit 0 (not KeyboardInterrupt's 130) and the stopped line."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lowlat.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--max-context-len", "256", "--no-cuda-graph", "--shutdown-grace", "5"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "lowlat serve: stopped" in out and "KeyboardInterrupt" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
