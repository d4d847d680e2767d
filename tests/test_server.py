"""The OpenAI-compatible server, run for real (three processes, ZMQ, uvicorn) on a tiny model, driven by the official
`openai` client: response shapes, greedy text equal to the offline `LLM`, a catalogue of bad requests, aborts on
disconnect, clean shutdown and a dying worker. Loopback only; every wait is bounded."""
import asyncio, contextlib, json, os, signal, subprocess, sys, time
import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from nanoserve.llm import LLM
from nanoserve.req import SamplingParams
from nanoserve.testing import ServerProcess, process_gone, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=256)     # 1024 KV slots; max_model_len is the model's 512
PROMPTS = ['The capital of France is', 'Colours:', 'def main():', 'Numbers: 0 1 2']

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    s = ServerProcess(model_dir, served_model_name='tiny', debug_hooks=True, **ENGINE).start()   # hooks: see _slowed
    pids = s.state()['pids']
    yield s
    code = s.stop(signal.SIGTERM)          # the shutdown a process manager does: clean, and nothing left behind
    assert code == 0, f'server exit code {code} after SIGTERM'
    for name, pid in pids.items(): assert process_gone(pid), f'{name} process {pid} outlived the server'

@pytest.fixture(scope='module')
def llm(model_dir): return LLM(model_dir, **ENGINE)

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60)

def _wait_idle(server, timeout: float = 20.0) -> dict:
    "The scheduler's counters once nothing runs or waits and the idle check has run."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = server.state()
        s = st['stats']
        if s.get('running') == 0 and s.get('waiting') == 0 and st['open_requests'] == 0: return s
        time.sleep(0.05)
    raise AssertionError(f'server not idle after {timeout} s: {st}')

@contextlib.contextmanager
def _slowed(server, step_delay: float):
    "The scheduler sleeps `step_delay` s before each engine step (a debug hook), for as long as the block runs."
    server.inject(step_delay=step_delay)
    try: yield
    finally: server.inject(step_delay=0.0)

def _greedy(llm, prompt, n=12, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False)[0].outputs[0]

# -- endpoints and shapes -------------------------------------------------------------------------------------------
def test_health_models_metrics(server, client):
    assert httpx.get(server.url + '/health').status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == ['tiny'] and models[0].object == 'model'
    assert models[0].model_extra['max_model_len'] == 512
    text = httpx.get(server.url + '/metrics').text
    for name in ['nanoserve:num_requests_running', 'nanoserve:num_requests_waiting', 'nanoserve:kv_cache_usage_perc',
                 'nanoserve:prefix_cache_hit_rate', 'nanoserve:prompt_tokens_total', 'nanoserve:generation_tokens_total',
                 'nanoserve:time_to_first_token_seconds_bucket', 'nanoserve:inter_token_latency_seconds_bucket']:
        assert name in text, name

def test_completion_greedy_equals_llm(client, llm):
    for prompt in PROMPTS:
        ref = _greedy(llm, prompt)
        r = client.completions.create(model='tiny', prompt=prompt, max_tokens=12, temperature=0, extra_body={'ignore_eos': True})
        assert r.object == 'text_completion' and r.id.startswith('cmpl-') and r.model == 'tiny'
        assert len(r.choices) == 1 and r.choices[0].index == 0
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == 'length'
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(llm.tokenizer(prompt).input_ids), 12)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12

def test_completion_stream(client, llm):
    ref = _greedy(llm, PROMPTS[0])
    chunks = list(client.completions.create(model='tiny', prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                            stream_options={'include_usage': True}, extra_body={'ignore_eos': True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert ''.join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == 'length'
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1 and all(c.object == 'text_completion' for c in chunks)
    plain = list(client.completions.create(model='tiny', prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)        # usage only when asked for

def test_sse_wire_format(server):
    "The raw bytes: `data: ` events, chat's role first, `[DONE]` last."
    body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 3, 'temperature': 0, 'stream': True}
    with httpx.stream('POST', server.url + '/v1/chat/completions', json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
        raw = r.read().decode()
    events = [e for e in raw.split('\n\n') if e]
    assert all(e.startswith('data: ') for e in events)
    assert events[-1] == 'data: [DONE]'
    first = json.loads(events[0][6:])
    assert first['object'] == 'chat.completion.chunk' and first['choices'][0]['delta']['role'] == 'assistant'

def test_chat(client, llm):
    msgs = [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'What is the capital of France?'}]
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model='tiny', messages=msgs, max_completion_tokens=10, temperature=0, extra_body={'ignore_eos': True})
    assert r.object == 'chat.completion' and r.id.startswith('chatcmpl-')
    assert r.choices[0].message.role == 'assistant' and r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model='tiny', messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={'include_usage': True}, extra_body={'ignore_eos': True}))
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + 10
    content_parts = [{'type': 'text', 'text': 'What is the capital of France?'}]
    r2 = client.chat.completions.create(model='tiny', messages=[msgs[0], {'role': 'user', 'content': content_parts}],
                                        max_tokens=10, temperature=0, extra_body={'ignore_eos': True})
    assert r2.choices[0].message.content == ref.outputs[0].text

def test_async_client_concurrent(server, llm):
    "Concurrent requests, streaming and not, each gets its own greedy text."
    refs = [_greedy(llm, p, 16).text for p in PROMPTS]
    async def one(c, prompt, stream):
        kw = dict(model='tiny', prompt=prompt, max_tokens=16, temperature=0, extra_body={'ignore_eos': True})
        if not stream: return (await c.completions.create(**kw)).choices[0].text
        return ''.join([ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)])
    async def main():
        async with AsyncOpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60) as c:
            return await asyncio.gather(*[one(c, p, i % 2 == 1) for i, p in enumerate(PROMPTS * 2)])
    assert asyncio.run(main()) == refs * 2

def test_sampling_options(client, llm):
    prompt = PROMPTS[1]
    full = _greedy(llm, prompt).text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if '\ufffd' not in full[i:i + 2] and full[i:i + 2].strip())
    r = client.completions.create(model='tiny', prompt=prompt, max_tokens=12, temperature=0, stop=[stop], extra_body={'ignore_eos': True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:full.index(stop)], 'stop')
    assert r.choices[0].model_extra['stop_reason'] == stop and r.usage.completion_tokens < 12
    first_id = _greedy(llm, prompt).token_ids[3]
    r = client.completions.create(model='tiny', prompt=prompt, max_tokens=12, temperature=0, extra_body={'stop_token_ids': [first_id], 'ignore_eos': True})
    assert r.choices[0].finish_reason == 'stop' and r.usage.completion_tokens <= 4
    kw = dict(model='tiny', prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=3, n=3,
              extra_body={'top_k': 50, 'min_p': 0.01, 'repetition_penalty': 1.1, 'ignore_eos': True}, presence_penalty=0.5, frequency_penalty=0.2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]     # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1                            # choice k is seeded with seed + k
    assert a.usage.completion_tokens == 24
    r = client.completions.create(model='tiny', prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=6, temperature=0, n=2, extra_body={'ignore_eos': True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [_greedy(llm, PROMPTS[0], 6).text] * 2 + [_greedy(llm, PROMPTS[2], 6).text] * 2
    ids = llm.tokenizer(PROMPTS[3]).input_ids
    r = client.completions.create(model='tiny', prompt=ids, max_tokens=6, temperature=0, extra_body={'ignore_eos': True})
    assert r.choices[0].text == _greedy(llm, PROMPTS[3], 6).text

def test_min_tokens_holds_stop_strings_back(client, llm):
    "A stop string inside the text of the first `min_tokens` tokens does not stop the request; the first one after it does."
    full, tok = _greedy(llm, PROMPTS[0], 16), llm.tokenizer
    for min_tokens, stop in [(10, tok.decode(full.token_ids[1:2])), (6, tok.decode(full.token_ids[:1]))]:
        before = tok.decode(full.token_ids[:min_tokens])
        at = full.text.find(stop, len(before) - len(stop) + 1)        # the first match that ends after that text
        want = (full.text, 'length') if at < 0 else (full.text[:at], 'stop')
        kw = dict(model='tiny', prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop],
                  extra_body={'min_tokens': min_tokens, 'ignore_eos': True})
        r = client.completions.create(**kw)
        assert (r.choices[0].text, r.choices[0].finish_reason) == want and r.usage.completion_tokens > min_tokens, (stop, r)
        chunks = list(client.completions.create(stream=True, **kw))
        assert (''.join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason) == want

def test_logprobs(client, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model='tiny', prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, extra_body={'ignore_eos': True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    if '\ufffd' not in ''.join(lp.tokens): assert ''.join(lp.tokens) == r.choices[0].text
    for got, want, tid in zip(lp.token_logprobs, ref.logprobs, ref.token_ids): assert abs(got - want[tid]) < 1e-4
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    msgs = [{'role': 'user', 'content': 'Hi'}]
    r = client.chat.completions.create(model='tiny', messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6                 # greedy: the chosen token is the top one
    streamed = list(client.chat.completions.create(model='tiny', messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=1, stream=True))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]

def test_return_tokens_as_token_ids(client, llm):
    "vLLM's `return_tokens_as_token_ids`: every token of the logprobs is 'token_id:{id}', so byte tokens that decode alike stay apart."
    prompt, ids_as_text = PROMPTS[2], {'ignore_eos': True, 'return_tokens_as_token_ids': True}
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    kw = dict(model='tiny', prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    r = client.completions.create(**kw, extra_body=ids_as_text)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f'token_id:{t}' for t in ref.token_ids]
    for top, want in zip(lp.top_logprobs, ref.logprobs):             # greedy: the chosen token is one of the top 3
        assert len(top) == 3
        got = {int(k.removeprefix('token_id:')): v for k, v in top.items()}
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)
    plain = client.completions.create(**kw, extra_body={'ignore_eos': True})
    assert plain.choices[0].text == r.choices[0].text
    assert plain.choices[0].logprobs.tokens == [llm.tokenizer.decode([t]) for t in ref.token_ids]   # without it: token text
    assert plain.choices[0].logprobs.text_offset == lp.text_offset                                 # offsets index the text
    msgs = [{'role': 'user', 'content': 'Hi'}]
    ref_chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(model='tiny', messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                                 top_logprobs=2, stream=True, extra_body=ids_as_text))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in content] == [f'token_id:{t}' for t in ref_chat.token_ids]
    for e, want in zip(content, ref_chat.logprobs):
        assert e.bytes == list(e.token.encode()) and {int(t.token.removeprefix('token_id:')) for t in e.top_logprobs} == want.keys()

# -- bad requests ---------------------------------------------------------------------------------------------------
BAD = [  # (endpoint, body changes, status, param or None, words in the message)
    ('completions', {'temperature': -1}, 400, 'temperature', 'temperature'),
    ('completions', {'top_p': 0}, 400, 'top_p', 'top_p'),
    ('completions', {'top_k': -5}, 400, 'top_k', 'top_k'),
    ('completions', {'min_p': 2}, 400, 'min_p', 'min_p'),
    ('completions', {'presence_penalty': 3}, 400, 'presence_penalty', 'presence_penalty'),
    ('completions', {'frequency_penalty': -3}, 400, 'frequency_penalty', 'frequency_penalty'),
    ('completions', {'repetition_penalty': 0}, 400, 'repetition_penalty', 'repetition_penalty'),
    ('completions', {'max_tokens': 0}, 400, 'max_tokens', 'max_tokens'),
    ('completions', {'n': 0}, 400, 'n', 'n must'),
    ('completions', {'logprobs': 21}, 400, 'logprobs', 'logprobs'),
    ('completions', {'stop': ['']}, 400, 'stop', 'stop'),
    ('completions', {'stop_token_ids': [-1]}, 400, 'stop_token_ids', 'stop_token_ids'),
    ('completions', {'max_tokens': 'lots'}, 400, 'max_tokens', 'integer'),
    ('completions', {'prompt': None}, 400, 'prompt', ''),
    ('completions', {'prompt': []}, 400, 'prompt', 'empty'),
    ('completions', {'prompt': [1, 2, 99999]}, 400, 'prompt', 'out of range'),
    ('completions', {'prompt': 'hello ' * 1000}, 400, 'prompt', 'maximum context length'),
    ('completions', {'max_tokens': 5000}, 400, 'prompt', 'maximum context length'),
    ('completions', {'model': 'gpt-4'}, 404, 'model', 'does not exist'),
    ('completions', {'best_of': 1, 'n': 2}, 400, 'best_of', 'best_of'),
    ('completions', {'logit_bias': {'5': 101}}, 400, 'logit_bias', 'logit_bias'),
    ('completions', {'frobnicate': 1}, 400, 'frobnicate', 'not supported'),
    ('chat/completions', {'messages': []}, 400, 'messages', 'messages'),
    ('chat/completions', {'messages': [{'content': 'no role'}]}, 400, 'messages', 'role'),
    ('chat/completions', {'messages': 'hello'}, 400, 'messages', ''),
    ('chat/completions', {'messages': [{'role': 'user', 'content': 'hi ' * 1000}]}, 400, 'messages', 'maximum context length'),
    ('chat/completions', {'top_logprobs': 2}, 400, 'top_logprobs', 'logprobs'),
    ('chat/completions', {'logprobs': True, 'top_logprobs': 25}, 400, 'top_logprobs', 'top_logprobs'),
    ('chat/completions', {'max_completion_tokens': -1}, 400, 'max_completion_tokens', 'max_completion_tokens'),
    ('chat/completions', {'temperature': 'hot'}, 400, 'temperature', ''),
    ('chat/completions', {'tools': [{'type': 'function', 'function': {'name': ''}}]}, 400, 'tools', 'tools'),
    ('chat/completions', {'model': 'other', 'stream': True}, 404, 'model', 'does not exist'),
    ('completions', {'temperature': 5, 'stream': True, 'top_p': 1.5}, 400, 'top_p', 'top_p'),
]

def _envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}, body
    return body['error']

@pytest.mark.parametrize('endpoint,change,status,param,words', BAD, ids=[f'{e}-{"-".join(c)}' for e, c, *_ in BAD])
def test_bad_request(server, endpoint, change, status, param, words):
    base = {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 4} if endpoint == 'completions' else \
           {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 4}
    r = httpx.post(f'{server.url}/v1/{endpoint}', json={**base, **change}, timeout=30)
    assert r.status_code == status, r.text
    err = _envelope(r)
    assert err['param'] == param and words in err['message'], err
    assert err['type'] == 'invalid_request_error'
    if 'maximum context length' in words: assert err['code'] == 'context_length_exceeded'

def test_bad_requests_other(server, client):
    r = httpx.post(server.url + '/v1/completions', content=b'{"prompt": "x",', headers={'content-type': 'application/json'})
    assert r.status_code == 400 and 'JSON' in _envelope(r)['message']
    assert httpx.get(server.url + '/v1/nothing').status_code == 404 and _envelope(httpx.get(server.url + '/v1/nothing'))
    r = httpx.get(server.url + '/v1/completions')
    assert r.status_code == 405 and _envelope(r)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model='tiny', prompt='x' * 3000, max_tokens=4)
    assert 'maximum context length' in e.value.message and e.value.code == 'context_length_exceeded'
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model='nope', messages=[{'role': 'user', 'content': 'x'}])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model='tiny', prompt='x', temperature=-0.5)
    assert e.value.param == 'temperature'
    s = _wait_idle(server)                 # nothing refused was left behind
    assert s['integrity'] == 'ok' and s['locked_pages'] == 0

# -- aborts ---------------------------------------------------------------------------------------------------------
def _kv_usage(server) -> float:
    for line in httpx.get(server.url + '/metrics').text.splitlines():
        if line.startswith('nanoserve:kv_cache_usage_perc'): return float(line.rsplit(' ', 1)[1])
    raise AssertionError('no kv_cache_usage_perc')

def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = _wait_idle(server)
    body = {'model': 'tiny', 'prompt': PROMPTS[0], 'max_tokens': 480, 'ignore_eos': True, 'temperature': 0, 'stream': True}
    with _slowed(server, 0.05):        # 480 steps take >= 24 s, until the abort: it is still running when we look
        with httpx.stream('POST', server.url + '/v1/completions', json=body, timeout=30) as r:
            lines = r.iter_lines()     # kept open: leaving the iterator early would close the connection
            events = [next(l for l in lines if l.startswith('data: ')) for _ in range(3)]
            mid = server.state()['stats']
            assert mid['running'] == 1 and mid['free_pages'] < before['free_pages']    # it holds pages while it runs
        after = _wait_idle(server)                                                     # closing the stream aborted it
    assert after['aborted'] == before['aborted'] + 1
    assert after['generated_tokens'] - before['generated_tokens'] < 480
    assert after['locked_pages'] == 0 and after['integrity'] == 'ok'
    assert after['free_pages'] + after['evictable_pages'] == after['num_pages']
    assert _kv_usage(server) == 0.0

def test_disconnect_while_waiting_aborts(server):
    "A non-streaming client that gives up (a client-side timeout) aborts its request too."
    before = _wait_idle(server)
    body = {'model': 'tiny', 'prompt': PROMPTS[1], 'max_tokens': 480, 'ignore_eos': True, 'temperature': 0}
    with _slowed(server, 0.05):           # 480 steps take >= 24 s, until the abort: the 0.5 s timeout fires long before
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + '/v1/completions', json=body, timeout=httpx.Timeout(30, read=0.5))
        after = _wait_idle(server)
    assert after['aborted'] == before['aborted'] + 1
    assert after['generated_tokens'] - before['generated_tokens'] < 480
    assert after['integrity'] == 'ok' and _kv_usage(server) == 0.0

def test_abort_some_of_many(server, llm):
    "Eight concurrent streams, four cancelled after their first chunk: the others are exact, nothing is left behind."
    before = _wait_idle(server)
    refs = [_greedy(llm, p, 24).text for p in PROMPTS]
    async def one(c, prompt, cancel):
        stream = await c.completions.create(model='tiny', prompt=prompt, max_tokens=24 if not cancel else 480, temperature=0,
                                            stream=True, extra_body={'ignore_eos': True})
        text = ''
        async for chunk in stream:
            text += chunk.choices[0].text
            if cancel:
                await stream.close()
                return None
        return text
    async def main():
        async with AsyncOpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60) as c:
            return await asyncio.gather(*[one(c, p, cancel) for p in PROMPTS for cancel in (False, True)])
    got = asyncio.run(main())
    assert got[0::2] == refs and got[1::2] == [None] * 4
    after = _wait_idle(server)
    assert after['aborted'] == before['aborted'] + 4
    assert after['generated_tokens'] - before['generated_tokens'] < 4 * 24 + 4 * 480
    assert after['locked_pages'] == 0 and after['integrity'] == 'ok' and _kv_usage(server) == 0.0

def test_prefix_cache_metrics(server, client):
    before = _wait_idle(server)
    prompt = 'Pages of keys and values are shared between requests that start alike. ' * 2
    for _ in range(2): client.completions.create(model='tiny', prompt=prompt, max_tokens=2, temperature=0)
    after = _wait_idle(server)
    assert after['prefix_hits'] - before['prefix_hits'] > 0          # the second request found the first one's pages
    r = client.completions.create(model='tiny', prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    text = httpx.get(server.url + '/metrics').text
    rate = next(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith('nanoserve:prefix_cache_hit_rate'))
    assert 0 < rate < 1

# -- lifecycle ------------------------------------------------------------------------------------------------------
def test_ctrl_c_mid_stream(model_dir):
    "SIGINT while a stream runs: the stream ends with an error event and [DONE], the server exits 0, no orphans."
    with ServerProcess(model_dir, **ENGINE) as s:
        pids = s.state()['pids']
        body = {'prompt': 'A', 'max_tokens': 480, 'ignore_eos': True, 'stream': True}
        with httpx.stream('POST', s.url + '/v1/completions', json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(l for l in lines if l.startswith('data: '))
            s.proc.send_signal(signal.SIGINT)
            rest = [l for l in lines if l.startswith('data: ')]
        assert rest[-1] == 'data: [DONE]' and 'shutting down' in json.loads(rest[-2][6:])['error']['message']
        assert s.proc.wait(30) == 0
    for pid in pids.values(): assert process_gone(pid)

def test_startup_failure_is_reported(model_dir):
    "A bad engine argument or model: the server exits 1 with a one-line reason, and leaves no process behind."
    code = 'import json, sys; from nanoserve.server import run_server; run_server(**json.loads(sys.argv[1]))'
    for kwargs, words in [(dict(model=model_dir, page_sise=4), 'unknown engine argument(s): page_sise'),
                          (dict(model='/nonexistent/model'), 'is not a model directory')]:
        r = subprocess.run([sys.executable, '-c', code, json.dumps(kwargs)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and words in r.stderr and 'Traceback' not in r.stderr, r.stderr

def test_worker_death(model_dir):
    "The scheduler dies mid-stream: the client gets an error event, the server exits non-zero, nothing is left."
    s = ServerProcess(model_dir, debug_hooks=True, **ENGINE).start()
    try:
        pids = s.state()['pids']
        s.inject(step_delay=0.05)                           # 480 steps take >= 24 s: the stream still runs at the kill
        c = OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=30)
        stream = c.completions.create(model=model_dir, prompt='A', max_tokens=480, stream=True, extra_body={'ignore_eos': True})
        next(iter(stream))
        os.kill(pids['scheduler'], signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            for _ in stream: pass
        assert 'scheduler process was killed by SIGKILL' in str(e.value.message)
        try: r = httpx.get(s.url + '/health', timeout=5)               # while it shuts down it answers 503 ...
        except httpx.TransportError: r = None                          # ... or has already closed its port
        assert r is None or (r.status_code == 503 and 'SIGKILL' in _envelope(r)['message'])
        assert s.proc.wait(30) == 1                           # exits by itself, with a message
        assert process_gone(pids['tokenizer'])
    finally:
        s.stop(signal.SIGKILL)
