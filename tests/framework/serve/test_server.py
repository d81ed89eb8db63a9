"""The OpenAI-compatible server through the official ``openai`` client: completions and chat,
streamed and not, against the offline ``generate``; stop strings, logprobs, seeded sampling;
32 concurrent streams; a client that drops mid-stream; overload; auth; size limits; a
request that fails inside a step."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, start

from framework import SamplingParams
from framework.engine.outputs import RequestOutput

PROMPTS = ["Hello", "The quick brown fox", "héllo wörld €", "1 + 1 ="]


def metrics(url: str, **headers) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def offline_out(llm, prompt, max_tokens, **kw) -> RequestOutput:
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    return llm.generate([prompt], sampling_params=sp, return_outputs=True)[0]


def wait_for(cond, timeout=30.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def blocks_used(url: str) -> float:
    return metrics(url)["piecewise_kv_blocks_used"]


# ---------------------------------------------------------------------- basics
def test_health_models_and_unknown_model(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    r = httpx.get(f"{server.url}/nope")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_greedy_equal_offline_ids_and_text(server, client, offline, stream):
    for prompt in PROMPTS + [[5, 17, 200, 3, 9]]:
        want = offline_out(offline, prompt, 24)
        kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        extra = {"return_token_ids": True}
        if stream:
            chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
            text = "".join(c.choices[0].text for c in chunks)
            ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            finish = chunks[-1].choices[0].finish_reason
            assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        else:
            r = client.completions.create(**kw, extra_body=extra)
            text, ids = r.choices[0].text, r.choices[0].model_extra["token_ids"]
            finish = r.choices[0].finish_reason
            assert r.model_extra["prompt_token_ids"] == want.prompt_token_ids
            assert r.usage.completion_tokens == len(want.token_ids)
            assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert ids == want.token_ids, prompt
        assert text == want.text, prompt
        assert finish == want.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_uses_the_folder_chat_template(server, client, offline, stream):
    want = offline.generate(
        ["Say hi"],
        sampling_params=SamplingParams(max_tokens=20),
        chat_template=True,
        return_outputs=True,
    )[0]
    kw = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    if stream:
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == want.finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, ids, usage = (
            r.choices[0].message.content,
            r.choices[0].model_extra["token_ids"],
            r.usage,
        )
        assert r.choices[0].message.role == "assistant"
    assert ids == want.token_ids and text == want.text
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == len(want.token_ids)


def test_streamed_usage_only_when_asked(client):
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, stream=True)
    )
    assert all(c.usage is None for c in chunks) and chunks[-1].choices


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}


# ---------------------------------------------------------------------- stop, logprobs, seeds
def _stop_case(offline):
    """A prompt whose greedy text holds two printable characters past its start: the stop."""
    for prompt in PROMPTS + ["abc", "xyz", "Once upon a time"]:
        text = offline_out(offline, prompt, 32, ignore_eos=True).text
        m = re.search(r"[ -~]{2}", text[3:])
        if m:
            stop = m.group(0)
            return prompt, stop, text[: text.index(stop)]
    pytest.skip("no greedy output with two printable characters in a row")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_strings_cut_the_text_across_chunks(client, offline, stream):
    prompt, stop, want = _stop_case(offline)
    kw = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=32,
        temperature=0,
        stop=["never-seen", stop],
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        assert not any(stop in c.choices[0].text for c in chunks)
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == want and finish == "stop"


def test_logprobs_equal_offline(client, offline):
    want = offline_out(offline, "Hello", 8, logprobs=3)
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 8 == len(lp.top_logprobs)
    for i, (tok, got) in enumerate(zip(want.token_ids, lp.token_logprobs)):
        assert got == pytest.approx(want.logprobs[i][tok], abs=1e-5)
        best = sorted(want.logprobs[i].values(), reverse=True)[:3]
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        # keyed by text: byte tokens that decode alike (U+FFFD) share a key, the best kept
        assert top[0] == pytest.approx(best[0], abs=1e-5)
        assert all(any(v == pytest.approx(b, abs=1e-5) for b in best) for v in top)
    c = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    chat_want = offline.generate(
        ["hi"],
        sampling_params=SamplingParams(max_tokens=4, logprobs=2),
        chat_template=True,
        return_outputs=True,
    )[0]
    for e, tok, lps in zip(content, chat_want.token_ids, chat_want.logprobs):
        assert e.logprob == pytest.approx(lps[tok], abs=1e-5)
        best = sorted(lps.values(), reverse=True)[:2]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(best, abs=1e-5)
    assert all(
        e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content
    )


def test_seeded_sampling_is_reproducible_and_equals_offline(client, offline):
    kw = dict(model=MODEL_NAME, prompt="Hello", max_tokens=16, temperature=0.9, seed=1234)
    extra = {"return_token_ids": True, "ignore_eos": True}
    a = client.completions.create(**kw, extra_body=extra).choices[0].model_extra["token_ids"]
    b = client.completions.create(**kw, extra_body=extra).choices[0].model_extra["token_ids"]
    c = client.completions.create(**{**kw, "seed": 99}, extra_body=extra)
    want = offline_out(offline, "Hello", 16, temperature=0.9, seed=1234, ignore_eos=True)
    assert a == b == want.token_ids
    assert c.choices[0].model_extra["token_ids"] != a


def test_engine_sampling_extensions_reach_the_sampler(client, offline):
    """top_k=1 at temperature 1 is greedy; min_p=1 keeps only the top token too."""
    greedy = offline_out(offline, "Hello", 10, ignore_eos=True).token_ids
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=10,
            temperature=1.0,
            extra_body={**extra, "ignore_eos": True, "return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == greedy, extra


# ---------------------------------------------------------------------- concurrency
def test_32_concurrent_streams_get_their_alone_tokens(server, offline):
    g = random.Random(3)
    prompts = [[g.randrange(256) for _ in range(g.randint(3, 40))] for _ in range(32)]
    want = [offline_out(offline, p, 16, ignore_eos=True).token_ids for p in prompts]
    statuses = []

    async def one(client, p):
        got = []
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=p,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        async for c in stream:
            got += c.choices[0].model_extra["token_ids"]
        return got

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts), return_exceptions=True)
        finally:
            await client.close()

    got = asyncio.run(main())
    errors = [g for g in got if isinstance(g, BaseException)]
    statuses = [getattr(e, "status_code", None) for e in errors]
    assert not errors, (statuses, errors[:2])
    assert got == want
    wait_for(lambda: blocks_used(server.url) == 0)
    m = metrics(server.url)
    assert m["piecewise_requests_running"] == 0 and m["piecewise_requests_waiting"] == 0


def test_client_dropping_mid_stream_is_aborted_and_freed(server, client, offline):
    before = metrics(server.url)["piecewise_client_aborts_total"]
    others_want = [offline_out(offline, p, 24, ignore_eos=True) for p in PROMPTS[:3]]
    results = {}

    def other(i, p):
        r = client.completions.create(
            model=MODEL_NAME,
            prompt=p,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        results[i] = r.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=other, args=(i, p)) for i, p in enumerate(PROMPTS[:3])]
    body = {
        "model": MODEL_NAME,
        "prompt": "drop me",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            for t in threads:
                t.start()
            events = []
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    break
    # the connection is closed here, long before its 200 tokens
    wait_for(lambda: metrics(server.url)["piecewise_client_aborts_total"] == before + 1)
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(3)] == [w.token_ids for w in others_want]
    wait_for(lambda: blocks_used(server.url) == 0)
    m = metrics(server.url)
    assert m["piecewise_engine_aborted_total"] >= 1
    assert m["piecewise_requests_running"] == 0 and m["piecewise_requests_waiting"] == 0


def test_a_non_streaming_client_that_leaves_is_aborted_too(server):
    before = metrics(server.url)["piecewise_client_aborts_total"]
    body = {"model": MODEL_NAME, "prompt": "wait", "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.05)
    wait_for(lambda: metrics(server.url)["piecewise_client_aborts_total"] == before + 1)
    wait_for(lambda: blocks_used(server.url) == 0)


# ---------------------------------------------------------------------- overload, failures
class GatedLLM:
    """The real LLM behind a gate: ``step`` waits until the gate opens, so requests pile up
    as waiting, deterministically. Forwards the public step API only."""

    def __init__(self, llm):
        self.llm = llm
        self.gate = threading.Event()
        self.max_model_len = llm.max_model_len

    def add_request(self, prompt, params=None, *, stream=False):
        return self.llm.add_request(prompt, params, stream=stream)

    def step(self):
        self.gate.wait()
        return self.llm.step()

    def abort(self, rid):
        return self.llm.abort(rid)

    def has_unfinished(self):
        return self.llm.has_unfinished()

    @property
    def stats(self):
        return self.llm.stats


@pytest.mark.parametrize("status", [429, 503])
def test_overload_is_refused_fast_and_the_server_recovers(spare_llm, chat_model_dir, status):
    gated = GatedLLM(spare_llm)
    srv = start(gated, chat_model_dir, max_waiting=2, overload_status=status, retry_after_s=3)
    try:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0}
        done = []

        def send():
            done.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60))

        held = [threading.Thread(target=send) for _ in range(2)]
        for t in held:
            t.start()
        wait_for(lambda: srv.loop.num_waiting == 2)
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
        assert time.monotonic() - t0 < 5  # refused, not queued
        assert r.status_code == status and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "overloaded"
        gated.gate.set()
        for t in held:
            t.join(60)
        assert [d.status_code for d in done] == [200, 200]
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert metrics(srv.url)[f'piecewise_requests_rejected_total{{status="{status}"}}'] == 1
    finally:
        gated.gate.set()
        srv.stop()


class FaultyLLM(GatedLLM):
    """Fails the requests whose prompt starts with token 255: the first one's output comes
    back with ``finish_reason="error"`` (a request failing inside a step), and with
    ``raise_step`` the whole step raises once."""

    POISON = 255

    def __init__(self, llm, raise_step=False):
        super().__init__(llm)
        self.gate.set()
        self.poisoned = set()
        self.raise_step = raise_step

    def add_request(self, prompt, params=None, *, stream=False):
        rid = self.llm.add_request(prompt, params, stream=stream)
        if list(prompt)[:1] == [self.POISON]:
            self.poisoned.add(rid)
        return rid

    def step(self):
        if self.raise_step and self.poisoned:
            self.poisoned.clear()
            raise RuntimeError("injected step failure")
        outs = self.llm.step()
        for i, o in enumerate(outs):
            if o.request_id in self.poisoned:
                self.poisoned.discard(o.request_id)
                self.llm.abort(o.request_id)
                outs[i] = RequestOutput(
                    o.request_id, o.prompt_token_ids, o.token_ids, finish_reason="error"
                )
        return outs


def test_a_request_failing_in_a_step_fails_alone(spare_llm, chat_model_dir, offline):
    faulty = FaultyLLM(spare_llm)
    srv = start(faulty, chat_model_dir)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        results = {}

        def good():
            results["good"] = (
                c.completions.create(
                    model=MODEL_NAME,
                    prompt=[1, 2, 3],
                    max_tokens=12,
                    temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                .choices[0]
                .model_extra["token_ids"]
            )

        t = threading.Thread(target=good)
        t.start()
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL_NAME, prompt=[255, 1, 2], max_tokens=12)
        assert e.value.status_code == 500 and "failed" in e.value.body["message"]
        t.join(60)
        assert results["good"] == offline_out(offline, [1, 2, 3], 12, ignore_eos=True).token_ids
        wait_for(lambda: blocks_used(srv.url) == 0)
    finally:
        srv.stop()


def test_a_step_that_raises_fails_its_requests_and_the_server_keeps_serving(
    spare_llm, chat_model_dir, offline
):
    faulty = FaultyLLM(spare_llm, raise_step=True)
    srv = start(faulty, chat_model_dir)
    try:
        body = {"model": MODEL_NAME, "prompt": [255, 4, 5], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            status = r.status_code
            text = r.read().decode()
        assert status == 500 and "injected step failure" in text
        wait_for(lambda: blocks_used(srv.url) == 0)
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        r2 = c.completions.create(
            model=MODEL_NAME,
            prompt=[1, 2, 3],
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        want = offline_out(offline, [1, 2, 3], 5, ignore_eos=True).token_ids
        assert r2.choices[0].model_extra["token_ids"] == want
        assert metrics(srv.url)["piecewise_step_errors_total"] == 1
    finally:
        srv.stop()


# ---------------------------------------------------------------------- auth, limits, 400s
def test_api_key_is_required_everywhere_but_health(spare_llm, chat_model_dir):
    srv = start(spare_llm, chat_model_dir, api_key="sekrit")
    try:
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekrit", max_retries=0)
        r = ok.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")
        finished = metrics(srv.url, Authorization="Bearer sekrit")
        wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        missing = httpx.post(f"{srv.url}/v1/completions", json=body)
        assert missing.status_code == 401 and "missing" in missing.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/v1/completions", json={}).status_code == 401
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200
        after = metrics(srv.url, Authorization="Bearer sekrit")
        key = 'piecewise_requests_finished_total{finish_reason="length"}'
        assert after.get(key) == finished.get(key)  # the refused requests ran nothing
    finally:
        srv.stop()


def test_size_limits_and_bad_parameters_are_4xx_and_the_server_keeps_serving(server, client):
    url = f"{server.url}/v1/completions"
    huge = httpx.post(url, json={"model": MODEL_NAME, "prompt": "x" * 100_000})
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    long_prompt = httpx.post(url, json={"model": MODEL_NAME, "prompt": "x" * 1000})
    assert long_prompt.status_code == 400
    assert long_prompt.json()["error"]["param"] == "prompt"
    too_many = httpx.post(url, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10_000})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    for field, value in [
        ("temperature", -1),
        ("n", 2),
        ("echo", True),
        ("logprobs", 99),
        ("top_p", "high"),
        ("stop", [""]),
        ("seed", 1.5),
        ("top_k", -5),
    ]:
        r = httpx.post(url, json={"model": MODEL_NAME, "prompt": "hi", field: value})
        assert r.status_code == 400, field
        assert r.json()["error"]["param"] == field, r.json()
        assert field in r.json()["error"]["message"]
    bad_id = httpx.post(url, json={"model": MODEL_NAME, "prompt": [1, 999]})
    assert bad_id.status_code == 400 and "999" in bad_id.json()["error"]["message"]
    garbage = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert garbage.status_code == 400
    no_model = httpx.post(url, json={"prompt": "hi"})
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].role"
    r = client.completions.create(model=MODEL_NAME, prompt="still here", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert blocks_used(server.url) == 0


def test_chat_without_a_chat_template_is_a_400(spare_llm, llama_checkpoint, tmp_path):
    import shutil

    from checkpoints import write_byte_tokenizer

    d = tmp_path / "plain"
    shutil.copytree(llama_checkpoint, d)
    write_byte_tokenizer(d, chat_template=None)
    srv = start(spare_llm, d)
    try:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "chat template" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_metrics_are_prometheus_text(server, client):
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = metrics(server.url)
    for name in (
        "piecewise_requests_running",
        "piecewise_requests_waiting",
        "piecewise_kv_blocks_used",
        "piecewise_preemptions_total",
        "piecewise_generation_tokens_per_second",
        "piecewise_time_to_first_token_seconds_count",
        "piecewise_inter_token_latency_seconds_count",
    ):
        assert name in m, name
    assert m["piecewise_time_to_first_token_seconds_count"] >= 1
    assert (
        m['piecewise_time_to_first_token_seconds_bucket{le="+Inf"}']
        == m["piecewise_time_to_first_token_seconds_count"]
    )


def test_load_generator_is_bounded_and_loopback_only(server, offline):
    from experiments.bench.serve import offline_run, run_load

    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    res = asyncio.run(run_load(server.url, MODEL_NAME, prompts, 6, 2, deadline_s=60))
    assert res.completed == 4 and not res.deadline_hit
    s = res.summary()
    assert s["errors"] == 0 and s["output_tok_s"] > 0 and s["ttft_ms_p50"] > 0
    _, want = offline_run(offline, prompts, 6, 2)
    assert [t.tokens for t in res.timings] == want
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(run_load("http://10.1.2.3:80", MODEL_NAME, prompts, 6, 2, deadline_s=1))


class CountingLLM(GatedLLM):
    """Counts the steps that start after ``requested`` is set and before the engine's
    ``abort`` runs."""

    def __init__(self, llm):
        super().__init__(llm)
        self.gate.set()
        self.requested = threading.Event()
        self.steps_between = 0
        self.aborted = threading.Event()

    def step(self):
        if self.requested.is_set() and not self.aborted.is_set():
            self.steps_between += 1
        time.sleep(0.01)  # slow steps: the abort lands while one is running
        return self.llm.step()

    def abort(self, rid):
        ok = self.llm.abort(rid)
        self.aborted.set()
        return ok


def test_an_abort_frees_the_blocks_before_the_next_step(spare_llm):
    from framework.serve.engine_loop import EngineLoop

    counting = CountingLLM(spare_llm)
    loop = EngineLoop(counting)
    loop.start()

    async def main():
        s = loop.submit([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(3):
            await s.queue.get()
        counting.requested.set()
        loop.abort(s)
        await asyncio.get_running_loop().run_in_executor(None, counting.aborted.wait, 10)

    try:
        asyncio.run(main())
        assert counting.aborted.is_set()
        assert counting.steps_between <= 1  # at most the step already running
        stats = spare_llm.stats
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        wait_for(lambda: loop.metrics.client_aborts == 1 and loop.num_running == 0)
    finally:
        loop.stop()
