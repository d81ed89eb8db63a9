"""The server when things go wrong, through the official ``openai`` client and raw HTTP:
overload is refused fast and recovers, a request failing inside a step fails alone, a step
that raises fails only its requests, an abort frees its blocks before the next step, the API
key guards every route but ``/health``, and size limits and bad parameters are 4xx naming the
field -- with the server still serving after each."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, blocks_used, metrics, offline_out, start, wait_for

from framework import SamplingParams
from framework.engine.outputs import RequestOutput


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
