"""Every response is strict JSON, every grammar-constrained output finished by `stop` parses and validates, and
hostile nesting gets a 400 with one log line at most: on a tiny model with random weights, loopback only."""
import json, math, re, time
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from nanoserve.testing import ServerProcess, save_tiny_model

xgr = pytest.importorskip('xgrammar')    # the optional extra nanoserve[structured]
jsonschema = pytest.importorskip('jsonschema')

ENGINE = dict(device='cpu', page_size=4, num_pages=512, enable_overlap=True)
ASK = [{'role': 'user', 'content': 'Say something.'}]

@pytest.fixture(scope='module')
def model(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp('logs') / 'server.log'
    with open(log_path, 'w') as log, ServerProcess(model, served_model_name='tiny', stderr=log, **ENGINE) as s:
        s.log_path = log_path
        yield s

def _strict(text: str):
    "json.loads that refuses NaN and Infinity, as strict parsers (JavaScript's JSON.parse, Go, Rust) do."
    def refuse(name): raise ValueError(f'{name} is not JSON')
    return json.loads(text, parse_constant=refuse)

# -- item: no response carries NaN or Infinity ----------------------------------------------------------------------
def test_masked_tokens_leave_top_logprobs():
    "A row the grammar masks: the top list holds allowed tokens only; a row masked whole still gives finite figures."
    from nanoserve.sampling import Sampler, SamplingBatch
    from nanoserve.req import Req, SamplingParams
    reqs = []
    for uid in range(3):
        r = Req(uid, [1, 2], SamplingParams(max_tokens=4, temperature=0, logprobs=5))
        r.advance(r.extend_len)
        reqs.append(r)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    logits[0, 3:] = float('-inf')           # three tokens allowed of five asked for
    logits[2] = float('-inf')               # nothing allowed
    rows = Sampler().sample(logits, SamplingBatch.from_reqs(reqs, 16)).host_logprobs()
    assert [len(row.top) for row in rows] == [3, 5, 0]
    assert {t for t, _ in rows[0].top} == {0, 1, 2}
    for row in rows:
        assert math.isfinite(row.logprob) and all(math.isfinite(lp) for _, lp in row.top)

def test_constrained_logprobs_are_json(server):
    "A choice grammar with top_logprobs: 200 and strict JSON, streamed or not (the conftest hook parses each event)."
    body = {'model': 'tiny', 'messages': ASK, 'max_tokens': 6, 'logprobs': True, 'top_logprobs': 5,
            'response_format': {'type': 'json_schema', 'json_schema': {'name': 'c', 'schema': {'enum': ['a', 'b']}}}}
    r = httpx.post(server.url + '/v1/chat/completions', json=body, timeout=60)
    assert r.status_code == 200, r.text
    content = _strict(r.text)['choices'][0]['logprobs']['content']
    assert content and all(len(entry['top_logprobs']) <= 5 for entry in content)
    with httpx.stream('POST', server.url + '/v1/chat/completions', json={**body, 'stream': True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith('data: ')]
    assert r.status_code == 200 and events[-1] == '[DONE]'
    for event in events[:-1]: _strict(event)
    completion = {'model': 'tiny', 'prompt': 'x', 'max_tokens': 4, 'logprobs': 5, 'structured_outputs': {'choice': ['yes', 'no']}}
    r = httpx.post(server.url + '/v1/completions', json=completion, timeout=60)
    assert r.status_code == 200, r.text
    _strict(r.text)

def test_sse_refuses_nan():
    "The event encoder refuses what JSON cannot say, so that a regression is an error, not a broken stream."
    from nanoserve.server.protocol import sse
    with pytest.raises(ValueError): sse({'logprob': float('-inf')})
    assert sse({'logprob': -1.5}) == 'data: {"logprob": -1.5}\n\n'

def test_the_conftest_hook_catches_infinity():
    "The strict-JSON hook of conftest.py flags a non-finite number in a body or an event, and nothing in valid ones."
    import conftest
    bodies = {'/json': ('application/json', b'{"logprob": -Infinity}'),
              '/sse': ('text/event-stream', b'data: {"a": 1}\n\ndata: {"b": NaN}\n\ndata: [DONE]\n\n'),
              '/ok': ('application/json', b'{"logprob": -1.0}'), '/text': ('text/plain', b'NaN')}
    def answer(request):
        kind, body = bodies[request.url.path]
        return httpx.Response(200, stream=httpx.ByteStream(body), headers={'content-type': kind})
    start = len(conftest.STRICT_JSON_VIOLATIONS)
    with httpx.Client(transport=httpx.MockTransport(answer), base_url='http://x') as client:
        for path in bodies: client.get(path)
        with client.stream('GET', '/sse') as r:
            next(r.iter_lines())             # a stream left early: checked as far as it was read (here, whole)
    found = conftest.STRICT_JSON_VIOLATIONS[start:]
    del conftest.STRICT_JSON_VIOLATIONS[start:]
    sse = 'GET http://x/sse: NaN is not JSON: {"b": NaN}'
    assert found == ['GET http://x/json: -Infinity is not JSON: {"logprob": -Infinity}', sse, sse]

# -- item: deep nesting is a 400, and a failure is one line in the log ----------------------------------------------
def _nested_schema(levels: int) -> dict:
    schema = {'type': 'string'}
    for _ in range(levels): schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return schema

def _log_lines(server) -> int:
    with open(server.log_path) as f: return sum(1 for _ in f)

@pytest.mark.parametrize('levels', [300, 40])
def test_deep_schema_is_refused(server, levels):
    "A schema nested 300 deep (past the body's bound) or 40 deep (past the schema's), in every place a schema goes."
    before = _log_lines(server)
    schema = _nested_schema(levels)
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'deep', 'schema': schema}}
    tool = {'type': 'function', 'function': {'name': 'f', 'parameters': schema}}
    bodies = [('chat/completions', {'messages': ASK, 'response_format': fmt}),
              ('completions', {'prompt': 'x', 'structured_outputs': {'json': json.dumps(schema)}}),
              ('completions', {'prompt': 'x', 'guided_json': schema}),
              ('chat/completions', {'messages': ASK, 'tools': [tool]})]
    for endpoint, body in bodies:
        r = httpx.post(f'{server.url}/v1/{endpoint}', json={'model': 'tiny', 'max_tokens': 2, **body}, timeout=60)
        assert r.status_code == 400, (endpoint, list(body), r.status_code, r.text[:300])
        assert 'deeper than' in r.json()['error']['message'], r.text[:300]
    assert _log_lines(server) == before            # a refused request writes nothing

def test_deep_schema_as_text_is_refused(server):
    "A schema given as text, nested past Python's own stack, is refused as too deep, not a 500."
    body = {'model': 'tiny', 'prompt': 'x', 'max_tokens': 2, 'structured_outputs': {'json': '[' * 5000 + ']' * 5000}}
    r = httpx.post(f'{server.url}/v1/completions', json=body, timeout=60)
    assert (r.status_code, r.json()['error']['param']) == (400, 'structured_outputs'), r.text[:300]

def test_schema_within_the_bound_is_served(server):
    "A schema nested 20 objects deep (41 levels) is served and followed."
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'deep', 'schema': _nested_schema(20)}}
    r = httpx.post(f'{server.url}/v1/chat/completions', timeout=120,
                   json={'model': 'tiny', 'messages': ASK, 'max_tokens': 200, 'response_format': fmt})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()['choices'][0]
    if choice['finish_reason'] == 'stop': jsonschema.validate(json.loads(choice['message']['content']), _nested_schema(20))
