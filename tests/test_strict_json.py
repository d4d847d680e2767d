"""Every response is strict JSON, every grammar-constrained output finished by `stop` parses and validates, and
hostile nesting gets a 400 with one log line at most: on a tiny model with random weights, loopback only."""
import json, math, random
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
    completion = {'model': 'tiny', 'prompt': 'x', 'max_tokens': 4, 'logprobs': 5,
                  'structured_outputs': {'choice': ['yes', 'no']}}
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
    if choice['finish_reason'] == 'stop':
        jsonschema.validate(json.loads(choice['message']['content']), _nested_schema(20))

# -- item: every JSON output a grammar finishes parses and validates ------------------------------------------------
# A vocabulary of every ASCII character (the control characters included), a few multi-character pieces and an eos:
# a random walk through a grammar's matcher over it can try any text a real tokenizer could spell.
VOCAB = [chr(i) for i in range(128)] + ['é', '€', '\\u0007', '\\"', '\\\\', '{"', '": ', ', "', '"}', 'abc', '"']
EOS = len(VOCAB)
PATTERNS = [r'^[a-z]{1,6}$', r'^\d{2,4}-\d{2}$', r'^(yes|no)$', r'^.{0,5}$', r'^[^a]{1,3}$', r'^\w+ \w+$',
            r'^[ -~]{1,4}$', r'^a\x07b$', r'^\n$', r'^"$']    # the last four can match characters JSON escapes

def _string(draw, enum_words):
    kind = draw(st.sampled_from(['plain', 'bounded', 'pattern', 'pattern+length', 'enum']))
    if kind == 'enum': return {'enum': draw(st.lists(enum_words, min_size=1, max_size=3, unique=True))}
    schema = {'type': 'string'}
    if kind in ('pattern', 'pattern+length'): schema['pattern'] = draw(st.sampled_from(PATTERNS))
    if kind in ('bounded', 'pattern+length'):
        low = draw(st.integers(0, 4))
        schema.update(draw(st.sampled_from([{'minLength': low}, {'maxLength': low + 3},
                                            {'minLength': low, 'maxLength': low + draw(st.integers(0, 3))}])))
    return schema

@st.composite
def schemas(draw, depth: int = 0):
    "Random schemas: objects nesting up to three deep, of strings with minLength, maxLength, pattern, enums."
    enum_words = st.text(st.characters(max_codepoint=0x7f), max_size=4)
    kinds = ['string', 'string', 'integer', 'array'] + (['object'] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == 'string': return _string(draw, enum_words)
    if kind == 'integer': return {'type': 'integer', 'minimum': 0, 'maximum': 99}
    if kind == 'array': return {'type': 'array', 'items': draw(schemas(depth=3)), 'maxItems': 2}
    names = draw(st.lists(st.sampled_from(['a', 'b', 'c', 'k\x07', 'q"']), min_size=1, max_size=3, unique=True))
    properties = {name: draw(schemas(depth=depth + 1)) for name in names}
    return {'type': 'object', 'properties': properties, 'required': names, 'additionalProperties': False}

def _inexact(schema) -> bool:
    "Whether `schema` holds a combination no grammar can follow exactly: pattern with a length, or an unsafe pattern."
    if isinstance(schema, list): return any(_inexact(s) for s in schema)
    if not isinstance(schema, dict): return False
    if 'pattern' in schema and ({'minLength', 'maxLength'} & set(schema) or schema['pattern'] in PATTERNS[-4:]):
        return True
    return any(_inexact(v) for k, v in schema.items() if k != 'enum')

@pytest.fixture(scope='module')
def char_compiler():
    info = xgr.TokenizerInfo(VOCAB + ['</s>'], stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2**32 - 1))
def test_every_finished_json_output_parses_and_validates(char_compiler, schema, seed):
    "A random walk through the grammar's matcher: any text it finishes is strict JSON that follows the schema."
    from nanoserve.req import StructuredOutputsParams
    from nanoserve.structured import build_grammar
    try: grammar = build_grammar(StructuredOutputsParams(json=schema), 'response_format')
    except ValueError as e:
        assert _inexact(schema), (schema, e)         # only what cannot be made exact is refused
        return
    assert not _inexact(schema), schema
    matcher = xgr.GrammarMatcher(char_compiler.compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB) + 1)
    closers = [VOCAB.index(piece) for piece in ('"', '}', ']')]
    walk = random.Random(seed)                      # uniform steps: hypothesis' own randoms favour few tokens
    text = ''
    for _ in range(400):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = xgr.testing.bitmask_to_bool_mask(bitmask, len(VOCAB) + 1)[0].nonzero()[:, 0].tolist()
        closing = [t for t in allowed if t in closers or t == EOS]
        token = walk.choice(closing if closing and walk.random() < 0.3 else allowed)
        assert matcher.accept_token(token)
        if token == EOS: break
        text += VOCAB[token]
    else: return                                    # not finished in 400 steps: nothing to check
    jsonschema.validate(_strict(text), schema)
