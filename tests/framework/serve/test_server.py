"""The OpenAI-compatible server through the official ``openai`` client: completions and chat,
streamed and not, against the offline ``generate``; stop strings, logprobs, seeded sampling;
32 concurrent streams; clients that drop mid-request; Prometheus metrics; the load generator.
Overload, failing requests and steps, auth and 4xx: ``test_server_failures.py``."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, blocks_used, metrics, offline_out, wait_for

from framework import SamplingParams

PROMPTS = ["Hello", "The quick brown fox", "héllo wörld €", "1 + 1 ="]


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
