"""lowlat serve in-process on 127.0.0.1, driven by the official openai client: completions and chat, streaming
and not, stop strings, logprobs, cancellation freeing KV, overload (503), bad parameters (tiny-llama, CPU)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need lowlat[serve] (httpx, openai, fastapi)")
openai = pytest.importorskip("openai", reason="the serve tests need lowlat[serve] (httpx, openai, fastapi)")
pytest.importorskip("fastapi", reason="the serve tests need lowlat[serve] (httpx, openai, fastapi)")
from _serve_util import MODEL, running_server, wait_for  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def server(request):
    """One server per loop: plain steps, and the overlapped loop (lowlat.runtime.overlap), which must serve alike."""
    with running_server(overlap=request.param) as s:
        yield s


@pytest.fixture()
def client(server):
    url = server[0]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_health_metrics(server, client):
    url = server[0]
    assert [m.id for m in client.models.list().data] == [MODEL]
    path = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["serving_path"]  # tiny-llama, float32
    assert path["plugin"] is None and path["summary"] == "plugin: none (auto: every step on the general path)"
    assert any(s.startswith("nvidia_mega: dtype: needs dtype bfloat16") for s in path["skipped"]), path
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for name in ("lowlat_requests_total", "lowlat_time_to_first_token_seconds", "lowlat_queue_depth",
                 "lowlat_steps_total", "lowlat_generation_tokens_total"):
        assert name in text


@pytest.mark.parametrize("plugins,dtype,want", [
    ("mirror", "float32", ["lowlat serve: plugin mirror (lowlat-test-mirror 1.0): auto: made for cpu and its guard"]),
    ("good", "bfloat16", ["lowlat serve: plugin: none (auto: every step on the general path)",
                          "  auto skipped good: dtype: needs dtype float32; the engine runs bfloat16"]),
])
def test_serve_says_which_path_serves_before_it_listens(plugins, dtype, want, tmp_path, monkeypatch, capsys):
    """``lowlat serve`` prints what ``lowlat run`` prints about the path (the plugin and why, or the general path
    and why auto skipped each plugin) before it listens, and /v1/models lists it as ``serving_path``."""
    import argparse

    import uvicorn
    from fastapi.testclient import TestClient
    from lowlat.cli import serve as serve_cli
    from plugin_dists import GOOD_SPEC, activate, make_plugin_dist
    from plugin_fakes import mirror_source

    site = tmp_path / "site"
    make_plugin_dist(site, "mirror", mirror_source())
    make_plugin_dist(site, "good", GOOD_SPEC)
    activate(site, monkeypatch)
    monkeypatch.setenv("LOWLAT_PLUGINS", plugins)
    seen = {}

    def run(self, sockets=None):  # instead of listening: what was printed by now, and what /v1/models says
        seen["err"] = capsys.readouterr().err
        seen["models"] = TestClient(self.config.app).get("/v1/models").json()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    parser = argparse.ArgumentParser(prog="lowlat")
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--device", "cpu", "--port", "0", "--dtype", dtype, "--max-context-len",
                              "64", "--no-cuda-graph"])
    assert serve_cli.serve(args) == 0, capsys.readouterr().err
    lines = seen["err"].splitlines()
    for i, prefix in enumerate(want):
        assert lines[i].startswith(prefix), seen["err"]
    assert lines[len(want)].startswith(f"lowlat serve: {MODEL} (LlamaForCausalLM) on http://"), seen["err"]
    path = seen["models"]["data"][0]["serving_path"]
    assert path["plugin"] == (plugins if plugins == "mirror" else None)
    assert lines[0] == f"lowlat serve: {path['summary']}"
    assert [f"  auto skipped {s}" for s in path["skipped"]] == lines[1:len(want)]


def test_completion_non_streaming_and_streaming_agree(client):
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == len(b"Hello there")
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len([c for c in chunks if c.choices]) >= 2  # it streamed in pieces


def test_chat_non_streaming_and_streaming(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_top_k_passes(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "ignore_eos": True})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_stop_string_cuts_the_text(server, client):
    kw = dict(model=MODEL, prompt="The stop test", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[6:8]
    got = client.completions.create(**kw, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == text[:text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == text[:text.find(stop)]
    _, loop, engine, _ = server  # the reader found the stop string; the engine request was aborted
    wait_for(lambda: loop.in_flight == 0 and not engine.scheduler.running, what="the stopped request gone")
    assert loop.metrics.requests.labels("stop")._value.get() >= 2


def test_stop_token_ids_end_the_request_at_that_token(client):
    kw = dict(model=MODEL, prompt="ids", max_tokens=16, temperature=0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = full.choices[0].token_ids
    assert len(ids) == 16
    idx = 5
    got = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "stop_token_ids": [ids[idx]]})
    first = ids.index(ids[idx])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].token_ids == ids[:first + 1]
    assert got.usage.completion_tokens == first + 1


def test_logprobs_completion_and_chat(client):
    got = client.completions.create(model=MODEL, prompt="log", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == 5
    for lp, top in zip(got.token_logprobs, got.top_logprobs):
        assert lp <= 0 and 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert len(chat) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in chat)


def test_client_disconnect_aborts_and_frees_kv(server, client):
    _, loop, engine, slow = server
    pool = engine.runner.kv_pool
    wait_for(lambda: loop.in_flight == 0, what="an idle server")
    free = pool.free_pages
    slow.s = 0.01
    try:
        stream = client.completions.create(model=MODEL, prompt="cancel me", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)
        assert pool.free_pages < free  # it holds pages while it runs
        stream.close()
        wait_for(lambda: pool.free_pages == free and loop.in_flight == 0 and not engine.scheduler.running,
                 what="the aborted request's KV pages back in the pool")
    finally:
        slow.s = 0.0


def test_overload_is_503_with_retry_after(server, client):
    _, loop, engine, slow = server  # max_batch_size 2, max_queued 2
    wait_for(lambda: loop.in_flight == 0, what="an idle server")
    slow.s = 0.01
    streams = []
    try:
        for _ in range(2):  # two run ...
            s = client.completions.create(model=MODEL, prompt="busy", max_tokens=200, stream=True,
                                          extra_body={"ignore_eos": True})
            next(iter(s))
            streams.append(s)
        for _ in range(2):  # ... two wait
            streams.append(client.completions.create(model=MODEL, prompt="wait", max_tokens=4, stream=True))
        wait_for(lambda: loop.pending == 2, what="two queued requests")
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.response.json()["error"]["code"] == "overloaded"
    finally:
        for s in streams:
            s.close()
        slow.s = 0.0
    wait_for(lambda: loop.in_flight == 0 and not engine.scheduler.running, what="the streams aborted")


@pytest.mark.parametrize("kw, param", [
    ({"top_p": 3}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": [0, 99999]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_parameters_are_400_naming_the_field(client, kw, param):
    args = {"model": MODEL, "prompt": "x", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    err = e.value.response.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_unknown_model_is_404_and_bad_chat_is_400(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert e.value.response.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       top_logprobs=2)
    assert e.value.response.json()["error"]["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.response.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_without_max_tokens_runs_to_the_context_limit(server, client):
    _, loop, _, _ = server
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == min(loop.max_context_len, loop.max_cached_tokens + 1)


def test_request_timeout_is_504(server, client):
    _, loop, _, slow = server
    slow.s = 0.02
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="slow", max_tokens=200, extra_body={"timeout": 0.3,
                                                                                               "ignore_eos": True})
        assert e.value.status_code == 504
    finally:
        slow.s = 0.0
    wait_for(lambda: loop.in_flight == 0, what="the timed-out request gone")


def test_raw_http_errors_keep_the_openai_shape(server):
    url = server[0]
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.get(f"{url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_non_streaming_client_that_gives_up_frees_kv(server):
    url, loop, engine, slow = server
    pool = engine.runner.kv_pool
    wait_for(lambda: loop.in_flight == 0, what="an idle server")
    free = pool.free_pages
    aborts = loop.metrics.requests.labels("abort")
    before = aborts._value.get()
    slow.s = 0.01
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "gone", "max_tokens": 200,
                                                       "ignore_eos": True}, timeout=0.5)
        wait_for(lambda: pool.free_pages == free and loop.in_flight == 0, timeout_s=10,
                 what="the abandoned request aborted")
        assert aborts._value.get() == before + 1  # aborted, not run to its end
    finally:
        slow.s = 0.0


def test_speculative_server_streams_what_plain_decoding_makes():
    """--speculative on lowlat serve: greedy text over SSE equals the plain server's, and VERIFY steps ran."""
    prompt = "abcabcabcabcabcabc"  # repetitive: the n-gram drafter proposes, some drafts are kept
    texts = {}
    for method in (None, "ngram"):
        kw = {"speculative_method": method, "num_draft_tokens": 3, "speculative_adaptive": False} if method else {}
        with running_server(**kw) as (url, _loop, engine, _slow):
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            chunks = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            texts[method] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            if method:
                d = engine.speculator.as_dict(engine)
                assert d["verify_steps"] > 0
                metrics = {ln.split()[0]: float(ln.split()[1]) for ln in httpx.get(f"{url}/metrics", timeout=5)
                           .text.splitlines() if ln.startswith("lowlat_spec_")}
                assert metrics["lowlat_spec_verify_steps_total"] == d["verify_steps"]
                assert metrics["lowlat_spec_acceptance_length"] == pytest.approx(d["acceptance_length"])
                assert metrics["lowlat_spec_acceptance_length"] >= 1.0  # the bonus token at least
                assert metrics["lowlat_spec_acceptance_rate"] == pytest.approx(d["acceptance_rate"])
    assert texts["ngram"] == texts[None] and texts[None]
