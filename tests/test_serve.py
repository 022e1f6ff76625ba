"""`sdsie serve` on the committed CPU stand-in pair: a live uvicorn server on 127.0.0.1 driven by the official
openai client and by httpx, checked against direct `generate()` calls on the same models. Most tests drive the
in-process Engine (the models in this process); the `process_*` tests drive the EngineProcess of
`sdsie serve --engine-process`, one child process shared by the module (spawning one costs seconds of imports and
loading)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from sdsie.clutch import ClutchConfig, EntropyClutch  # noqa: E402
from sdsie.decoding import DecodeConfig, SamplingConfig, generate  # noqa: E402
from sdsie.models import load_pair, render_chat  # noqa: E402
from sdsie.serve import ServeConfig, parse_clutch, protocol  # noqa: E402
from sdsie.serve.app import create_app  # noqa: E402
from sdsie.serve.cli import config_from_args, configure  # noqa: E402
from sdsie.serve.metrics import OUTCOMES  # noqa: E402
from sdsie.serve.process import EngineProcess, EngineStartError  # noqa: E402
from sdsie.serve.text import TextStream  # noqa: E402
from sdsie.serve.worker import Delta, Done, Engine, Failed, Job  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "reproductions" / "standin" / "cpu"
MODEL = "standin"
# The stand-in's entropy sits near 7 bits; these thresholds make the clutch engage and release within a few dozen
# tokens of PROMPT (both seed settings, at 0.55-1.25 bits, never engage on it).
MIXED = ClutchConfig(theta_low=6.5, theta_high=7.0, alpha=0.5)
K = MIXED.k_draft
PROMPT = "import os\nimport sys\n"
EOS = (1,)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LIMIT, CONTEXT, QUEUE = 200, 256, 4


# ------------------------------------------------------------------------------------------------
# Fixtures: the pair, a live server, and an in-process app with an API key and no chat template


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and OpenMP spin-waits hurt on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return load_pair(PAIR / "target", PAIR / "scout", tokenizer=PAIR / "tokenizer")


@pytest.fixture(scope="module")
def tokenizer(pair):
    tok = copy.deepcopy(pair.tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def _config(**kw) -> ServeConfig:
    base = dict(target=str(PAIR / "target"), scout=str(PAIR / "scout"), model_name=MODEL, clutch=MIXED,
                max_tokens=LIMIT, context=CONTEXT, queue_size=QUEUE)
    return ServeConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(pair, tokenizer):
    return Engine(pair.target, tokenizer, _config(), scout=pair.scout)


@pytest.fixture(scope="module")
def url(engine):
    yield from _serve(engine)


def _serve(engine):
    """A live uvicorn server over `engine` on a free port of 127.0.0.1: yields its URL, stops it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other processes
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def idle_url(url):
    """The live server with its engine idle, so that what a test counts in /metrics is its own requests' doing."""
    wait_idle(url)
    return url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def direct(pair, ids, max_new, sampling: SamplingConfig | None = None, eos=EOS):
    config = DecodeConfig(max_new_tokens=max_new, eos_token_id=eos, sampling=sampling or SamplingConfig())
    return generate(pair.target, ids, config, scout=pair.scout, clutch=EntropyClutch(MIXED))


def completion(client, prompt=PROMPT, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, extra_body={"return_token_ids": True}, **kw)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^sdsie_{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"no metric {name} in\n{text}"
    return float(found.group(1))


def wait_idle(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if not health["busy"] and health["queued"] == 0:
            return
        assert time.monotonic() < deadline, f"the engine is still busy: {health}"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------
# The engine's hook


def test_on_tokens_sees_every_token_and_can_stop_the_run(pair) -> None:
    ids = pair.tokenizer.encode(PROMPT)
    full = direct(pair, ids, 20)
    steps: list[list[int]] = []
    seen = generate(pair.target, ids, DecodeConfig(max_new_tokens=20, eos_token_id=EOS), scout=pair.scout,
                    clutch=EntropyClutch(MIXED), on_tokens=steps.append)
    assert [t for s in steps for t in s] == full.tokens == seen.tokens and len(steps) == 1 + full.stats.cycles
    calls = []
    stopped = generate(pair.target, ids, DecodeConfig(max_new_tokens=20), scout=pair.scout,
                       on_tokens=lambda s: calls.append(s) or len(calls) == 3)
    assert stopped.stop_reason == "stopped" and len(calls) == 3 and stopped.stats.cycles == 2
    assert stopped.tokens == [t for s in calls for t in s] and len(stopped.tokens) < 20
    assert stopped.tokens == generate(pair.target, ids, DecodeConfig(max_new_tokens=20), scout=pair.scout
                                      ).tokens[: len(stopped.tokens)]


@pytest.mark.parametrize("tree", [None, (2, 2)], ids=["chain", "tree"])
def test_on_wait_comes_once_per_cycle_after_its_launch_and_before_its_read(pair, monkeypatch, tree) -> None:
    """generate calls on_wait in every cycle (the prefill's too) just before the one host read, after on_tokens of
    the cycle before: the slot where a server's streaming work overlaps the device."""
    from sdsie.decoding import engine

    events: list[str] = []
    real = engine.HostRead.wait
    monkeypatch.setattr(engine.HostRead, "wait", lambda self: events.append("read") or real(self))
    ids = pair.tokenizer.encode(PROMPT)
    config = DecodeConfig(max_new_tokens=20, tree_widths=tree)
    clutch = MIXED if tree is None else dataclasses.replace(MIXED, k_draft=len(tree))
    result = generate(pair.target, ids, config, scout=pair.scout, clutch=EntropyClutch(clutch),
                      on_tokens=lambda _: events.append("tokens"), on_wait=lambda: events.append("wait"))
    assert 0 < result.stats.speculate_cycles < result.stats.cycles  # speculate cycles and plain steps
    assert events == ["wait", "read", "tokens"] * (1 + result.stats.cycles)
    assert result.tokens == generate(pair.target, ids, config, scout=pair.scout, clutch=EntropyClutch(clutch)).tokens


def test_the_engine_emits_text_from_on_wait_or_after_the_run(pair, monkeypatch) -> None:
    """Engine.run sends each step's text from the next cycle's on_wait (and what is left after generate returns),
    never from on_tokens, where the event loop it wakes would take the lock during the next launch."""
    from sdsie.serve import worker

    state = {"in_wait": False, "running": False}
    seen: list[tuple[str, bool, bool]] = []

    def watched(*args, on_wait, **kwargs):
        def wait() -> None:
            state["in_wait"] = True
            on_wait()
            state["in_wait"] = False

        state["running"] = True
        try:
            return generate(*args, on_wait=wait, **kwargs)
        finally:
            state["running"] = False

    monkeypatch.setattr(worker, "generate", watched)
    engine = Engine(pair.target, pair.tokenizer, _config(), scout=pair.scout)
    request = protocol.parse_completion({"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0},
                                        engine.limits, pair.tokenizer)
    engine.run(Job(request, lambda e: seen.append((type(e).__name__, state["running"], state["in_wait"]))))
    deltas = [s for s in seen if s[0] == "Delta"]
    assert seen[-1][0] == "Done" and len(deltas) >= 10
    assert all(in_wait for _, running, in_wait in deltas if running)  # during the run: only from on_wait
    assert sum(running for _, running, _ in deltas) >= len(deltas) - 1  # at most the last step's text comes after


def test_the_energy_window_opens_off_the_engine_thread_and_gives_the_request_its_joules(pair) -> None:
    """The window's first NVML read runs on the energy thread, unsynchronized, while the prefill is launched; the
    request's usage carries the window's energy; a reading that fails is no reading (None), not a failed request."""
    from sdsie.telemetry.energy import EnergyMeter
    from sdsie.telemetry.fake_nvml import FakeNvml, FakeNvmlError

    t0, reads = time.perf_counter(), []

    def counter() -> float:  # a 100 W device, its counter in mJ
        reads.append(threading.current_thread().name)
        return 1e6 + 100.0 * (time.perf_counter() - t0) * 1e3

    nvml = FakeNvml(energy_mj=counter)
    meter = EnergyMeter(nvml=nvml, sync=lambda: nvml.events.append("sync"), min_window_s=1e-3)
    engine = Engine(pair.target, pair.tokenizer, _config(), scout=pair.scout, meter=meter)
    request = protocol.parse_completion({"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0},
                                        engine.limits, pair.tokenizer)
    reads.clear()  # the meter's backend check read the counter
    nvml.events.clear()
    done: list[Done] = []
    engine.run(Job(request, lambda e: isinstance(e, Done) and done.append(e)))
    sdsie = done[0].usage["sdsie"]
    assert reads[0].startswith("sdsie-energy") and reads[1] == threading.current_thread().name
    assert nvml.events == ["energy", "sync", "energy"]  # opened at once, closed after a sync
    assert sdsie["energy_j"] == pytest.approx(100.0 * sdsie["seconds"], rel=0.1)  # the window spans the run
    nvml.fail["nvmlDeviceGetTotalEnergyConsumption"] = FakeNvmlError(999, "Unknown Error")
    engine.run(Job(request, lambda e: isinstance(e, Done) and done.append(e)))
    assert done[1].usage["sdsie"]["energy_j"] is None and done[1].usage["completion_tokens"] == 20


# ------------------------------------------------------------------------------------------------
# Completions, chat, streaming


def test_greedy_completion_is_generate_token_for_token_and_the_clutch_acts(pair, tokenizer, client) -> None:
    ids = tokenizer.encode(PROMPT)
    ref = direct(pair, ids, 22)  # 22: no speculate cycle of this run is cut short by the token budget
    spec = [c for c in ref.cycles if c.speculated]
    assert "S" in ref.decisions and "F" in ref.decisions and all(c.k == K for c in spec)  # the case is gated
    resp = completion(client, max_tokens=22)
    choice = resp.choices[0]
    assert choice.token_ids == ref.tokens
    assert choice.text == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert choice.finish_reason == "length" and resp.model == MODEL and resp.object == "text_completion"
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 22, len(ids) + 22)
    s = usage.sdsie
    assert s["decisions"] == ref.decisions and s["cycles"] == ref.stats.cycles
    assert (s["speculate_cycles"], s["drafted"], s["accepted"]) == (
        ref.stats.speculate_cycles, ref.stats.drafted, ref.stats.accepted)
    assert s["scout_forwards"] == s["speculate_cycles"] * K and s["speculate_cycles"] == ref.decisions.count("S")
    assert s["gear_int4_share"] is None and s["energy_j"] is None  # no gear, no NVML: nothing, never 0


def test_stream_concatenates_to_the_whole_answer(pair, tokenizer, client) -> None:
    whole = completion(client, max_tokens=20)
    chunks = list(completion(client, max_tokens=20, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.sdsie["decisions"] == whole.usage.sdsie["decisions"]


def test_chat_applies_the_template_and_streams_the_same_text(pair, tokenizer, client) -> None:
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "import os"}]
    ids = render_chat(tokenizer, messages)
    assert tokenizer.decode(ids).endswith("<|assistant|>")
    ref = direct(pair, ids, 16)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=False, presence_penalty=0,  # neutral values pass
                                          extra_body={"return_token_ids": True})
    assert resp.choices[0].token_ids == ref.tokens and resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert resp.choices[0].message.role == "assistant" and resp.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_goes_through_the_rejection_sampler_seeded(pair, tokenizer, client) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7)
    ref = direct(pair, tokenizer.encode(PROMPT), 24, sampling)
    assert ref.stats.speculate_cycles > 0  # drafts were verified by rejection sampling
    first = completion(client, max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    again = completion(client, max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    assert first.choices[0].token_ids == again.choices[0].token_ids == ref.tokens
    assert first.usage.sdsie["decisions"] == ref.decisions


def test_stop_string_ends_the_text_before_it_and_the_run(pair, tokenizer, client) -> None:
    text = completion(client, max_tokens=40).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    resp = completion(client, max_tokens=40, stop=[stop, "never appears"])
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 40  # generation ended at the cycle that wrote the stop string
    streamed = list(completion(client, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


COUNTERS = {"completion_tokens_total": "completion_tokens", "cycles_total": "cycles",
            "engaged_cycles_total": "engaged_cycles", "speculate_cycles_total": "speculate_cycles",
            "drafted_tokens_total": "drafted", "accepted_tokens_total": "accepted",
            "target_forwards_total": "target_forwards", "dropped_forwards_total": "dropped_forwards"}


def test_models_health_and_metrics(idle_url, client) -> None:
    url = idle_url
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["sdsie"] == {
        "int4": None, "norms_fused": False, "compile": None, "compile_prefill": False, "prefill_graphs": False,
        "gear": [], "scout": True}
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    ok = 'requests_total{outcome="ok"}'
    before = {name: metric(url, name) for name in (ok, *COUNTERS)}
    resp = completion(client, max_tokens=22)  # gated: speculate cycles that accept drafts, and fallback cycles
    usage = resp.usage.sdsie | {"completion_tokens": resp.usage.completion_tokens}
    assert 0 < usage["speculate_cycles"] <= usage["engaged_cycles"] < usage["cycles"] and 0 < usage["accepted"]
    response = httpx.get(f"{url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert metric(url, ok) == before[ok] + 1
    for name, field in COUNTERS.items():  # each counter grew by what this request's usage says it did
        assert metric(url, name) - before[name] == usage[field], name
    for name in ("tokens_per_second", "acceptance_rate", "engaged_cycle_share"):  # defined once drafts exist
        assert metric(url, name) > 0
    assert metric(url, "acceptance_rate") <= 1 and metric(url, "engaged_cycle_share") <= 1
    assert "int4" not in response.text and "joule" not in response.text  # no gear, no NVML: no such line


# ------------------------------------------------------------------------------------------------
# Bad input: status, OpenAI error body naming the field, and the server keeps serving

BAD = [
    ("completions", b"{not json", None, "not valid JSON"),
    ("completions", b"[1, 2]", None, "JSON object"),
    ("completions", {"max_tokens": 4}, "prompt", "missing required field 'prompt'"),
    ("chat/completions", {"max_tokens": 4}, "messages", "missing required field 'messages'"),
    ("chat/completions", {"messages": []}, "messages", "non-empty list"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "must be >= 1"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens", "must be >= 1"),
    ("completions", {"prompt": "x", "max_tokens": LIMIT + 1}, "max_tokens", f"limit of {LIMIT}"),
    ("completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens", "must be an integer"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", "must be >= 1"),
    ("completions", {"prompt": list(range(3, 3 + CONTEXT))}, "prompt", f"cache of {CONTEXT}"),
    ("completions", {"prompt": list(range(3, CONTEXT - 5)), "max_tokens": 10}, "max_tokens", f"cache of {CONTEXT}"),
    ("completions", {"prompt": [5, 99999]}, "prompt", "token ids must lie in"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "batch of 2 prompts"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, "model", "'gpt-4' does not exist"),
    ("completions", {"prompt": "x", "temperature": -0.1}, "temperature", "must be >= 0"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("completions", {"prompt": "x", "stop": 5}, "stop", "must be a string or a list"),
    ("completions", {"prompt": "x", "stop": ["a", 1]}, "stop", "must be a string or a list"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("completions", {"prompt": "x", "seed": 1.5}, "seed", "must be an integer"),
    ("completions", {"prompt": "x", "n": 2}, "n", "n must be 1"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ("completions", {"prompt": "x", "logprobs": 3}, "logprobs", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs",
     "not supported"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "phrase"), BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p, _x)
                                                                              in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(url, endpoint, body, param, phrase) -> None:
    if isinstance(body, bytes):
        response = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(f"{url}/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_bad_input_through_the_openai_client_raises_its_error(client) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        completion(client, max_tokens=4, temperature=-1)
    assert completion(client, max_tokens=2).usage.completion_tokens == 2  # still serving


# ------------------------------------------------------------------------------------------------
# Queue, load, disconnects


SPECS = [{"model": MODEL, "prompt": p, "max_tokens": 2 + j % 3, "temperature": t, "seed": j, "return_token_ids": True}
         for j, (p, t) in enumerate((p, t) for p in (PROMPT, "def main(args):\n    ", "class Parser:\n", "The fox")
                                    for t in (0, 0.9))]


def test_load_fifo_queue_answers_each_request_as_alone(idle_url) -> None:
    """200 requests from 16 concurrent clients against a queue of 4: every answer equals its solo run, the only
    non-200 answers are 503 queue-full with Retry-After, and the server is healthy and idle afterwards."""
    url = idle_url
    n_requests, n_clients = 200, 16
    solo = [httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0] for body in SPECS]
    full_before = metric(url, 'requests_total{outcome="queue_full"}')
    answers: dict[int, dict] = {}
    refusals: list[httpx.Response] = []

    async def client_task(ids: list[int]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for i in ids:
                while True:
                    r = await http.post("/v1/completions", json=SPECS[i % len(SPECS)])
                    if r.status_code != 503:
                        assert r.status_code == 200, r.text
                        answers[i] = r.json()["choices"][0]
                        break
                    refusals.append(r)
                    await asyncio.sleep(0.05)  # a test client retries sooner than Retry-After asks

    async def main() -> None:
        await asyncio.gather(*(client_task(list(range(c, n_requests, n_clients))) for c in range(n_clients)))

    asyncio.run(main())
    assert len(answers) == n_requests
    for i, answer in answers.items():
        expected = solo[i % len(SPECS)]
        assert (answer["token_ids"], answer["text"]) == (expected["token_ids"], expected["text"]), i
    assert refusals, "16 clients against a queue of 4 should have been refused at times"
    for r in refusals:
        assert r.json()["error"]["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
    assert metric(url, 'requests_total{outcome="queue_full"}') == full_before + len(refusals)
    wait_idle(url)
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": MODEL, "busy": False, "queued": 0}


def test_streaming_disconnect_stops_generation_at_the_next_cycle(idle_url) -> None:
    url = idle_url
    cancelled, tokens = metric(url, 'requests_total{outcome="cancelled"}'), metric(url, "completion_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed here, after one chunk
    wait_idle(url)
    assert metric(url, 'requests_total{outcome="cancelled"}') == cancelled + 1
    assert metric(url, "completion_tokens_total") - tokens < LIMIT  # it stopped early
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_waiting_client_that_disconnects_cancels_its_request(idle_url) -> None:
    url = idle_url
    cancelled, tokens = metric(url, 'requests_total{outcome="cancelled"}'), metric(url, "completion_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    wait_idle(url)
    assert metric(url, 'requests_total{outcome="cancelled"}') == cancelled + 1
    assert metric(url, "completion_tokens_total") - tokens < LIMIT


# ------------------------------------------------------------------------------------------------
# An app with an API key, a tokenizer without a chat template, and a gear


def test_api_key_and_missing_chat_template(pair) -> None:
    engine = Engine(pair.target, pair.tokenizer, _config(api_key="sk-test"), scout=pair.scout)
    with TestClient(create_app(engine)) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert http.get("/health").status_code == 200
        key = {"Authorization": "Bearer sk-test"}
        assert http.get("/v1/models", headers=key).json()["data"][0]["id"] == MODEL
        r = http.post("/v1/chat/completions", headers=key, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "no chat template" in r.json()["error"]["message"]
        assert http.post("/v1/completions", headers=key, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_static_cache_engine_carries_nothing_from_one_request_to_the_next(pair) -> None:
    engine = Engine(pair.target, pair.tokenizer, _config(kv_cache="static"), scout=pair.scout)
    other = {"prompt": "class Parser:\n", "max_tokens": 12, "temperature": 0.9, "seed": 3, "return_token_ids": True}
    first = {"prompt": PROMPT, "max_tokens": 22, "temperature": 0, "return_token_ids": True}
    with TestClient(create_app(engine)) as http:
        answers = [http.post("/v1/completions", json=body).json() for body in (first, other, first)]
    ref = direct(pair, pair.tokenizer.encode(PROMPT), 22)
    assert answers[0]["choices"][0]["token_ids"] == answers[2]["choices"][0]["token_ids"] == ref.tokens
    assert answers[0]["usage"]["sdsie"] == {**answers[2]["usage"]["sdsie"], "seconds": answers[0]["usage"]["sdsie"][
        "seconds"]}
    assert answers[2]["usage"]["sdsie"]["decisions"] == ref.decisions  # the clutch starts afresh


def test_with_prefill_graphs_the_warm_up_runs_each_length_twice_and_requests_ask_for_them(monkeypatch) -> None:
    """Under prefill_graphs the warm-up runs each length twice (`warm_up_runs`: where a cache's layers must wait
    for its first prompt, that prompt runs eagerly and the second captures); served requests' DecodeConfig asks
    for the graphs. (The graphs need CUDA: the engine's generate is replaced here; DecodeConfig.prefill_graphs has
    its own tests.)"""
    from sdsie.serve import worker

    engine = Engine.load(_config(tokenizer=str(PAIR / "tokenizer"), kv_cache="static"))
    object.__setattr__(engine.config, "prefill_graphs", True)  # what --cuda-graphs --prefill-graphs sets
    object.__setattr__(engine.config, "cuda_graphs", True)
    asked: list[tuple[int, bool]] = []

    def fake_generate(target, prompt, config, **kw):
        asked.append((len(prompt) + config.max_new_tokens, config.prefill_graphs))

    monkeypatch.setattr(worker, "generate", fake_generate)
    engine.warm_up((40, 256))
    assert asked == [(40, True), (40, True), (256, True), (256, True)]
    from sdsie.decoding.sampling import GREEDY

    request = protocol.GenerationRequest(prompt_ids=(1, 2), max_tokens=4, sampling=GREEDY)
    assert engine.decode_config(request).prefill_graphs


def test_warm_up_runs_a_short_request_at_each_cache_length_before_serving(monkeypatch) -> None:
    """Engine.load warms each configured cache length up with a few-token request that fills it to that length
    (prompt plus max_new_tokens), as served requests run (the scout and clutch), and counts none of it; a length
    past the context is refused by name, before any runs."""
    from sdsie.serve import worker

    calls: list[tuple[int, int, int]] = []
    real = worker.generate

    def recording(target, prompt, config, **kw):
        result = real(target, prompt, config, **kw)
        calls.append((len(prompt), config.max_new_tokens, len(result.tokens)))
        assert kw["scout"] is not None and kw["clutch"] is not None and result.stop_reason == "stopped"
        return result

    monkeypatch.setattr(worker, "generate", recording)
    config = _config(tokenizer=str(PAIR / "tokenizer"), kv_cache="static", warm_up=(40, 256))
    engine = Engine.load(config)
    assert [(p, p + n) for p, n, _ in calls] == [(20, 40), (32, 256)]  # each run's room: its cache length
    assert all(1 + worker.WARM_UP_CYCLES <= tokens < n for _, n, tokens in calls)  # stopped after a few cycles
    assert sum(engine.metrics.requests(o) for o in OUTCOMES) == 0
    with pytest.raises(ValueError, match="warm_up: a cache length must be 2 to the context's 256 positions, got 300"):
        engine.warm_up((64, 300))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="warm_up must be cache lengths"):
        _config(warm_up=(1,))
    from sdsie.serve.process import WARM_UP_S

    # the engine process waits for its child's warm-up too: WARM_UP_S more a length, unless told a limit
    warmed = _config(tokenizer=str(PAIR / "tokenizer"), warm_up=(256, 512))
    assert EngineProcess(warmed).start_timeout == EngineProcess(_config(tokenizer=str(PAIR / "tokenizer"))
                                                                ).start_timeout + 2 * WARM_UP_S
    assert EngineProcess(warmed, start_timeout=30.0).start_timeout == 30.0


def test_gear_share_in_usage_matches_generate(pair) -> None:
    from sdsie.quant.gated import gate_model

    target = copy.deepcopy(pair.target)
    gear = gate_model(target, ["down_proj"], layers=[0])
    engine = Engine(target, pair.tokenizer, _config(gear=("down_proj",), gear_layers=(0,)), scout=pair.scout,
                    gear=gear)
    ids = pair.tokenizer.encode(PROMPT)
    with TestClient(create_app(engine)) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    ref = generate(target, ids, DecodeConfig(max_new_tokens=8, eos_token_id=EOS), scout=pair.scout,
                   clutch=EntropyClutch(MIXED), gear=gear)
    gears = [ref.prefill_gear_int4, *(c.gear_int4 for c in ref.cycles)]
    s = r.json()["usage"]["sdsie"]
    assert s["gear_int4_share"] == sum(gears) / len(gears) and s["decisions"] == ref.decisions
    assert 0 < s["gear_int4_share"] < 1  # the gear changed with the clutch within the request
    assert "sdsie_int4_forward_share" in engine.metrics.render(0, False)


def test_int4_target_is_quantized_fused_compiled_and_answers_as_generate_on_that_model(pair, caplog) -> None:
    """--int4 group --compile: Engine.load quantizes the target's linears and LM head, fuses q/k/v, gate/up and the
    norms, and wraps it for a compiled decode step (dynamo's eager backend here); the served tokens, with the scout
    and clutch, are generate()'s on the same quantized model. The INT4 products are the kernel's float64 reference
    (the interpreter takes a second a call; the kernel has its own tests)."""
    from reproductions.decode_e2e import int4_kernel
    from sdsie.decoding import DecodeCompiled
    from sdsie.quant import Int4Linear, quantize_for_decode
    from sdsie.quant.fuse import FusedMLP
    from sdsie.quant.norms import NormFusedLayer

    config = _config(tokenizer=str(PAIR / "tokenizer"), int4="group", compile="eager", compile_prefill=True,
                     kv_cache="static")
    with int4_kernel(torch.device("cpu")), caplog.at_level(logging.WARNING, logger="sdsie.serve.worker"):
        engine = Engine.load(config)
        assert "--compile without --warm-up: the first request at each cache length compiles its decode step and " \
               "the prefill" in caplog.text  # the wait a client would meet is said at start
        model = engine.target.model
        assert isinstance(engine.target, DecodeCompiled) and isinstance(model.lm_head, Int4Linear)
        assert engine.target._prefill is not None  # prompts (and the scout's verification) compiled too
        layers = list(model.model.layers)
        assert all(isinstance(layer, NormFusedLayer) and isinstance(layer.layer.mlp, FusedMLP) for layer in layers)
        with TestClient(create_app(engine)) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                   "return_token_ids": True})
            served = http.get("/v1/models").json()["data"][0]["sdsie"]
        assert served == {"int4": "group", "norms_fused": True, "compile": "eager", "compile_prefill": True,
                          "prefill_graphs": False, "gear": [], "scout": True}  # what a client reads of the served form
        assert r.status_code == 200, r.text
        target = copy.deepcopy(pair.target)
        quantize_for_decode(target)
        ids = pair.tokenizer.encode(PROMPT)
        ref = generate(target, ids, DecodeConfig(max_new_tokens=10, eos_token_id=EOS, kv_cache="static"),
                       scout=pair.scout, clutch=EntropyClutch(MIXED))
    assert r.json()["choices"][0]["token_ids"] == ref.tokens
    assert r.json()["usage"]["sdsie"]["decisions"] == ref.decisions


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_graphs", [False, True])
def test_on_the_gpu_int4_compiled_graphed_serving_answers_as_generate_on_the_served_model(prompt_graphs: bool) -> None:
    """The GPU form of the test above: the INT4 kernels (the mma GEMV with its norm epilogues at M = 1), inductor and
    CUDA graphs, and with `prompt_graphs` the prompt compiled too and replayed as a graph (--compile-prefill
    --prefill-graphs); the served tokens and decisions are generate()'s on the engine's own (compiled) target."""
    config = _config(tokenizer=str(PAIR / "tokenizer"), int4="group", compile="inductor", kv_cache="static",
                     cuda_graphs=True, device="cuda", dtype="bfloat16", compile_prefill=prompt_graphs,
                     prefill_graphs=prompt_graphs)
    engine = Engine.load(config)
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    with TestClient(create_app(engine)) as http:
        answers = [http.post("/v1/completions", json=body).json() for _ in range(2)]
    ids = engine.tokenizer.encode(PROMPT)
    ref = generate(engine.target, ids, DecodeConfig(max_new_tokens=24, eos_token_id=EOS, kv_cache="static",
                                                    cuda_graphs=True, prefill_graphs=prompt_graphs),
                   scout=engine.scout, clutch=EntropyClutch(MIXED))
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"] == ref.tokens
    assert answers[0]["usage"]["sdsie"]["decisions"] == ref.decisions


@pytest.mark.parametrize("pdl", [True, False])
def test_compile_with_inductor_takes_the_suites_options_on_cuda_and_none_elsewhere(pair, monkeypatch, pdl) -> None:
    """prepare_target compiles the step with inductor_options: combo kernels on CUDA, PDL where the GPU takes it;
    another backend, or a CPU, gets none."""
    import sdsie.kernels.device
    from sdsie.serve.worker import prepare_target

    calls: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    monkeypatch.setattr(sdsie.kernels.device, "pdl_on", lambda device: pdl)
    for device, backend in (("cuda", "inductor"), ("cpu", "inductor"), ("cuda", "eager")):
        prepare_target(pair.target, ServeConfig(target="t", compile=backend, kv_cache="static", device=device))
    options = {"combo_kernels": True, **({"triton.enable_pdl": True} if pdl else {})}
    assert calls == [{"backend": "inductor", "options": options, "dynamic": False}, {"backend": "inductor",
                     "dynamic": False}, {"backend": "eager", "dynamic": False}]


def test_int4_and_compile_options_refuse_what_they_cannot_serve(monkeypatch) -> None:
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--target", "t", "--int4", "per-channel", "--compile", "--kv-cache", "static"])
    config = config_from_args(args)
    assert (config.int4, config.fuse_norms, config.compile) == ("per-channel", True, "inductor")
    args = p.parse_args(["--target", "t", "--int4", "group", "--no-fuse-norms", "--compile", "eager",
                         "--compile-prefill", "--kv-cache", "static"])
    config = config_from_args(args)
    assert (config.fuse_norms, config.compile, config.compile_prefill) == (False, "eager", True)
    with pytest.raises(ValueError, match="compile_prefill compiles the prompt's forward"):
        config_from_args(p.parse_args(["--target", "t", "--compile-prefill", "--kv-cache", "static"]))
    args = p.parse_args(["--target", "t", "--kv-cache", "static", "--cuda-graphs", "--prefill-graphs"])
    assert config_from_args(args).prefill_graphs
    with pytest.raises(ValueError, match="prefill_graphs replays the prompt's forward as a CUDA graph: it needs "
                                         "cuda_graphs"):
        config_from_args(p.parse_args(["--target", "t", "--kv-cache", "static", "--prefill-graphs"]))
    config = config_from_args(p.parse_args(["--target", "t", "--kv-cache", "static", "--cuda-graphs",
                                            "--prefill-graphs", "--compile", "--compile-prefill"]))
    assert (config.prefill_graphs, config.compile, config.compile_prefill) == (True, "inductor", True)
    with pytest.raises(SystemExit):
        p.parse_args(["--target", "t", "--int4", "awq"])
    with pytest.raises(ValueError, match="--no-fuse-norms is an option of --int4"):
        config_from_args(p.parse_args(["--target", "t", "--no-fuse-norms"]))
    with pytest.raises(ValueError, match="compile needs kv_cache='static'"):
        config_from_args(p.parse_args(["--target", "t", "--compile"]))
    with pytest.raises(ValueError, match="int4 must be one of"):
        ServeConfig(target="t", int4="awq")
    with pytest.raises(ValueError, match="pass one of them"):
        ServeConfig(target="t", int4="group", gear=("down_proj",), clutch=MIXED)
    with pytest.raises(ValueError, match="float16's range"):
        ServeConfig(target="t", int4="group", dtype="float16")
    assert not ServeConfig(target="t", int4="group", dtype="float16", fuse_norms=False).fuse_norms
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=2):  # restored after (monkeypatch's undo hides the option)
        engine = Engine.load(_config(tokenizer=str(PAIR / "tokenizer"), compile="eager", kv_cache="static",
                                     context=2048))
        assert torch._dynamo.config.recompile_limit == 8  # one compilation per 256-position cache length
    assert engine.target.model is not None and engine.limits.context == 2048
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter cannot run the INT4 kernel
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine.load(_config(int4="group"))


# ------------------------------------------------------------------------------------------------
# Pieces: incremental text, the command line


class _Chars:
    """A tokenizer double: token i decodes to VOCAB[i]; id 0 is a special token."""

    VOCAB = ["<eos>", "ab", "c", "d", "\ufffd", "é", "STOP", "S", "TOP"]

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))
        return text.replace("\ufffdé", "é")  # a character split over two tokens decodes whole once complete


@pytest.mark.parametrize(("steps", "stop", "pieces", "stopped"), [
    ([[1], [2, 3], [0]], (), ["ab", "cd", ""], False),
    ([[1], [4], [5, 2]], (), ["ab", "", "éc"], False),  # U+FFFD held back until its character completes
    ([[1, 7], [8, 2]], ("STOP",), ["", "ab"], True),  # a stop string over two steps: nothing of it is sent
    ([[1], [6, 2]], ("zz", "STOP"), ["", "ab"], True),
    ([[1, 2, 3, 3], [2]], ("STOP",), ["ab", "c"], False),  # the last len(stop) - 1 characters wait; finish() sends them
])
def test_text_stream_releases_only_final_text(steps, stop, pieces, stopped) -> None:
    stream = TextStream(_Chars(), stop)
    assert [stream.feed(s) for s in steps] == pieces and stream.stopped is stopped
    tail = stream.finish()
    full = _Chars().decode([t for s in steps for t in s])
    assert "".join(pieces) + tail == (full[: min(full.find(s) for s in stop if s in full)] if stopped else full)


def test_text_stream_decodes_a_bounded_window_per_step() -> None:
    """A step decodes the tokens since the last final text and their context, not the whole sequence (it runs
    between the engine's cycles): 600 steps, no decode of more than a few tokens, the same text."""
    lengths: list[int] = []

    class Counting(_Chars):
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    ids = [[1 + i % 3] if i % 7 else [4, 5] for i in range(600)]
    stream = TextStream(Counting(), ("STOPX",))
    text = "".join(stream.feed(step) for step in ids) + stream.finish()
    assert text == _Chars().decode([t for step in ids for t in step])
    assert max(lengths) <= 6


def test_cli_options_become_the_server_config(tmp_path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--target", "t", "--scout", "s", "--clutch", "tuned", "--gear", "mlp.down_proj",
                         "--gear-layers", "0,2", "--kv-cache", "static", "--api-key", "k", "--port", "9",
                         "--chat-template", str(template), "--warm-up", "512", "1024"])
    config = config_from_args(args)
    assert config.clutch == parse_clutch("tuned") and config.gear == ("mlp.down_proj",)
    assert config.gear_layers == (0, 2) and config.kv_cache == "static" and config.host == "127.0.0.1"
    assert config.chat_template == TEMPLATE and config.api_key == "k" and config.port == 9
    assert config.warm_up == (512, 1024)
    assert config_from_args(p.parse_args(["--target", "t", "--scout", "s", "--clutch", "off"])).clutch is None
    assert parse_clutch("1,2") == ClutchConfig(theta_low=1.0, theta_high=2.0)
    assert parse_clutch("1,2,0.5").alpha == 0.5
    for bad in ("fast", "1", "2,1"):
        with pytest.raises(ValueError, match="clutch|theta_low"):
            parse_clutch(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--target", "t", "--clutch", "fast"])
    with pytest.raises(ValueError, match="cuda_graphs needs kv_cache='static'"):
        config_from_args(p.parse_args(["--target", "t", "--cuda-graphs"]))
    with pytest.raises(ValueError, match="gear needs a clutch"):
        ServeConfig(target="t", gear=("down_proj",))


@pytest.mark.parametrize(("flag", "layout"), [([], "thread"), (["--engine-process"], "process")])
def test_sdsie_serve_runs_the_engine_in_the_layout_its_flag_names(monkeypatch, flag, layout) -> None:
    """Without --engine-process the models load in the server's process (Engine.load); with it, an EngineProcess
    starts and the server's process loads none. Either engine is the one served, and stopped afterwards."""
    import sdsie.serve.app as app_module
    import sdsie.serve.process as process_module
    from sdsie.serve import cli

    made: list[tuple[str, object]] = []

    class Stub:
        def __init__(self, kind: str) -> None:
            self.kind, self.stopped = kind, False
            made.append((kind, self))

        def start(self) -> None:
            self.started = True

        def stop(self) -> None:
            self.stopped = True

    served: list[object] = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, config: Stub("thread")))
    monkeypatch.setattr(process_module, "EngineProcess", lambda config, threads=None: Stub("process"))
    monkeypatch.setattr(app_module, "run_server", served.append)
    p = argparse.ArgumentParser()
    configure(p)
    assert cli.run(p.parse_args(["--target", "t", *flag])) == 0
    assert logging.getLogger("sdsie").isEnabledFor(logging.INFO)  # the engine's load lines reach stderr
    ((kind, engine),) = made
    assert kind == layout and served == [engine] and engine.stopped
    assert getattr(engine, "started", False) == (layout == "process")  # a process engine starts before serving


# ------------------------------------------------------------------------------------------------
# The engine in its own process (`sdsie serve`'s default): the same answers, cancellation over the pipe


@pytest.fixture(scope="module")
def process_engine():
    return EngineProcess(_config(tokenizer=str(PAIR / "tokenizer"), chat_template=TEMPLATE), threads=1)


@pytest.fixture(scope="module")
def process_url(process_engine):
    yield from _serve(process_engine)
    assert process_engine._process is None  # stopped with the server


@pytest.fixture(scope="module")
def process_client(process_url):
    return openai.OpenAI(base_url=f"{process_url}/v1", api_key="unused", max_retries=0)


def test_process_engine_answers_as_generate_streamed_or_not(pair, tokenizer, process_client) -> None:
    ids = tokenizer.encode(PROMPT)
    ref = direct(pair, ids, 22)
    assert "S" in ref.decisions and "F" in ref.decisions  # the clutch gates within the request
    resp = completion(process_client, max_tokens=22)
    assert resp.choices[0].token_ids == ref.tokens and resp.choices[0].finish_reason == "length"
    s = resp.usage.sdsie
    assert (s["decisions"], s["cycles"], s["speculate_cycles"], s["drafted"], s["accepted"]) == (
        ref.decisions, ref.stats.cycles, ref.stats.speculate_cycles, ref.stats.drafted, ref.stats.accepted)
    chunks = list(completion(process_client, max_tokens=22, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(ref.tokens, skip_special_tokens=True) and len(chunks) > 4
    assert chunks[-1].usage.completion_tokens == 22 and chunks[-1].usage.sdsie["decisions"] == ref.decisions
    messages = [{"role": "user", "content": "import os"}]  # the chat template renders in the server's process
    chat = process_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == direct(pair, render_chat(tokenizer, messages), 8).tokens


def test_process_engine_disconnect_frees_the_engine(process_url) -> None:
    url = process_url
    wait_idle(url)
    cancelled, tokens = metric(url, 'requests_total{outcome="cancelled"}'), metric(url, "completion_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_idle(url)
    assert metric(url, 'requests_total{outcome="cancelled"}') == cancelled + 1
    assert metric(url, "completion_tokens_total") - tokens < LIMIT  # the child stopped early
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
    assert after["usage"]["completion_tokens"] == 2


def test_process_engine_full_queue_is_503_with_retry_after(process_engine, process_url) -> None:
    """While the child runs a long request, QUEUE jobs fill the server process's queue; the next request is refused
    with 503 and Retry-After, and the queued jobs, cancelled, end as cancelled without generating."""
    url = process_url
    wait_idle(url)
    body = {"prompt": PROMPT, "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True, "stream": True}
    ended: list = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # held: a collected iterator closes the stream
        assert next(line for line in lines if line.startswith("data: "))
        request = protocol.parse_completion({"prompt": "x", "max_tokens": 2}, process_engine.limits,
                                            process_engine.tokenizer)
        jobs = [Job(request, ended.append) for _ in range(QUEUE)]
        for job in jobs:
            process_engine.submit(job)
        health = httpx.get(f"{url}/health").json()
        assert health["queued"] == QUEUE, (health, ended)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        for job in jobs:
            job.cancel()
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    wait_idle(url)
    assert [(type(e), e.finish_reason, e.token_ids) for e in ended] == [(Done, "cancelled", [])] * QUEUE


def test_process_engine_that_fails_to_load_says_why(tmp_path) -> None:
    engine = EngineProcess(_config(target=str(tmp_path / "no-model"), tokenizer=str(PAIR / "tokenizer")), threads=1)
    with pytest.raises(EngineStartError, match="failed to load the models: FileNotFoundError: model path .*no-model"):
        engine.start()
    assert not engine.running


def test_process_engine_whose_child_dies_fails_the_request_and_health() -> None:
    engine = EngineProcess(_config(tokenizer=str(PAIR / "tokenizer"), chat_template=TEMPLATE), threads=1)
    engine.start()
    events: list = []
    first, ended = threading.Event(), threading.Event()

    def emit(event) -> None:
        events.append(event)
        first.set()
        if not isinstance(event, Delta):
            ended.set()

    request = protocol.parse_completion({"prompt": PROMPT, "max_tokens": LIMIT, "ignore_eos": True}, engine.limits,
                                        engine.tokenizer)
    engine.submit(Job(request, emit))
    assert first.wait(30)
    engine._process.kill()
    assert ended.wait(30)
    assert isinstance(events[-1], Failed) and "engine process exited (exit code -9)" in events[-1].message
    with TestClient(create_app(engine)) as http:
        health = http.get("/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]
        refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    assert not engine.running  # the app's lifespan stopped it
