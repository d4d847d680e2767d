"""Inputs a client may make as large as it likes are bounded, and error messages quote at most a short piece of them;
a request carrying two credentials is refused; every field OpenAI's reference defines for completions and chat is
accepted (honoured or ignored, as chapter 14 lists), null included, while a field no API defines is a 400 naming it.
A real server on a tiny model, through HTTP."""
import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from nanoserve.req import MAX_QUOTED
from nanoserve.server.protocol import (
    IGNORED_FIELDS, MAX_ALLOWED_TOKEN_IDS, MAX_GRAMMAR_CHARS, MAX_N, MAX_STOP, MAX_STOP_CHARS,
    ChatCompletionRequest, CompletionRequest)
from nanoserve.testing import ServerProcess, save_tiny_model

KEY = 'sk-limits'
ENGINE = dict(device='cpu', page_size=4, num_pages=256)
SHORT_BODY = 2 * MAX_QUOTED + 400      # an error envelope quoting at most MAX_QUOTED characters of the request

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True)
    with ServerProcess(str(model), served_model_name='tiny', api_key=KEY, **ENGINE) as s: yield s

def post(server, endpoint: str, body: dict, headers=None) -> httpx.Response:
    headers = [('Authorization', f'Bearer {KEY}')] if headers is None else headers
    return httpx.post(f'{server.url}/v1/{endpoint}', json=body, headers=headers, timeout=120)

def completion(**kw) -> dict: return {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 2, **kw}
def chat(**kw) -> dict:
    return {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 2, **kw}

def refused_param(r: httpx.Response) -> str | None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert len(r.content) < SHORT_BODY, len(r.content)
    return r.json()['error']['param']

# -- bounded inputs --------------------------------------------------------------------------------------------------
def test_a_bad_word_is_bounded_as_a_stop_string_is(server):
    assert post(server, 'completions', completion(bad_words=['x' * MAX_STOP_CHARS] * MAX_STOP)).status_code == 200
    assert refused_param(post(server, 'completions', completion(bad_words=['x' * (MAX_STOP_CHARS + 1)]))) == 'bad_words'
    assert refused_param(post(server, 'chat/completions', chat(bad_words=['x' * 100_000] * 64))) == 'bad_words'

def test_allowed_token_ids_and_grammars_are_bounded(server):
    assert refused_param(post(server, 'completions',
                              completion(allowed_token_ids=[1] * (MAX_ALLOWED_TOKEN_IDS + 1)))) == 'allowed_token_ids'
    regex = 'a' * (MAX_GRAMMAR_CHARS + 1)
    assert refused_param(post(server, 'completions', completion(structured_outputs={'regex': regex}))) == \
        'structured_outputs'
    assert refused_param(post(server, 'completions', completion(guided_regex=regex))) == 'guided_regex'
    schema = {'type': 'object', 'description': 'x' * MAX_GRAMMAR_CHARS}
    format_ = {'type': 'json_schema', 'json_schema': {'name': 'big', 'schema': schema}}
    assert refused_param(post(server, 'chat/completions', chat(response_format=format_))) == 'response_format'
    choices = ['y' * 1000] * (MAX_GRAMMAR_CHARS // 1000 + 1)
    assert refused_param(post(server, 'completions', completion(guided_choice=choices))) == 'guided_choice'

def test_error_messages_quote_client_input_briefly(server):
    r = post(server, 'completions', completion(model='m' * 2**20))
    assert r.status_code == 404 and len(r.content) < SHORT_BODY, (r.status_code, len(r.content))
    assert r.json()['error']['code'] == 'model_not_found' and 'mmmm' in r.json()['error']['message']
    r = httpx.get(f"{server.url}/v1/models/{'m' * 60_000}", headers={'Authorization': f'Bearer {KEY}'}, timeout=60)
    assert r.status_code == 404 and len(r.content) < SHORT_BODY, (r.status_code, len(r.content))
    long_name = 'frobnicate' * 100_000
    assert refused_param(post(server, 'completions', completion(**{long_name: 1}))) == long_name[:MAX_QUOTED]
    for body in [completion(logit_bias={'9' * 100_000: 1}), completion(logit_bias={'5': 'x' * 100_000}),
                 completion(stop_token_ids=['x' * 100_000]), completion(bad_words=[' ' * 100_000]),
                 chat(tool_choice={'type': 'function', 'function': {'name': 'f' * 100_000}}),
                 chat(tool_choice='t' * 100_000), chat(response_format={'type': 'r' * 100_000}),
                 completion(structured_outputs={'choice': 'c' * 100_000}),
                 completion(structured_outputs={'grammar': 'root ::= ' + 'x' * 50_000}),
                 completion(structured_outputs={'json': '{' + 'a' * 50_000}),
                 chat(tools=[{'type': 'function', 'function': {'name': ''}, 'pad': 'p' * 100_000}])]:
        endpoint = 'chat/completions' if 'messages' in body else 'completions'
        assert refused_param(post(server, endpoint, body)) is not None

# -- credentials -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('keys', [(KEY, 'sk-other'), ('sk-other', KEY), (KEY, KEY)])
def test_two_authorization_headers_are_refused(server, keys):
    headers = [('Authorization', f'Bearer {key}') for key in keys]
    r = post(server, 'completions', completion(), headers=headers)
    assert r.status_code in (400, 401), r.status_code
    assert 'Authorization' in r.json()['error']['message']

def test_one_authorization_header_is_enough(server):
    assert post(server, 'completions', completion()).status_code == 200
    assert post(server, 'completions', completion(), headers=[('Authorization', 'Bearer sk-other')]).status_code == 401

# -- OpenAI's fields -------------------------------------------------------------------------------------------------
SAMPLE_VALUES = {       # a plausible value for each field the tests send on their own
    'audio': {'voice': 'alloy', 'format': 'wav'},
    'metadata': {'app': 'test'}, 'modalities': ['text'], 'moderation': {'model': 'omni-moderation-latest'},
    'prediction': {'type': 'content', 'content': 'Hello there'}, 'prompt_cache_key': 'k',
    'prompt_cache_options': {'mode': 'implicit'}, 'prompt_cache_retention': '24h', 'reasoning_effort': 'low',
    'safety_identifier': 'user-1', 'service_tier': 'auto', 'store': False, 'user': 'user-1', 'verbosity': 'low',
    'web_search_options': {'search_context_size': 'low'}, 'suffix': '!'}

def sdk_fields(params) -> set[str]:
    return set(params.CompletionCreateParamsBase.__annotations__) | {'stream'}

@pytest.mark.parametrize('kind', ['completions', 'chat'])
def test_every_field_of_openais_reference_is_known(kind):
    params, model = (completion_params, CompletionRequest) if kind == 'completions' else (chat_params,
                                                                                            ChatCompletionRequest)
    unknown = sdk_fields(params) - set(model.model_fields) - set(IGNORED_FIELDS)
    assert not unknown, unknown

@pytest.mark.parametrize('name', sorted(IGNORED_FIELDS))
def test_ignored_fields_are_accepted(server, name):
    body = chat(**{name: SAMPLE_VALUES[name]}, temperature=0, ignore_eos=True)
    r = post(server, 'chat/completions', body)
    assert r.status_code == 200, r.text[:300]
    plain = post(server, 'chat/completions', chat(temperature=0, ignore_eos=True)).json()
    assert r.json()['choices'][0]['message'] == plain['choices'][0]['message']

def test_null_is_accepted_for_every_optional_field(server):
    for params, endpoint, body in [(chat_params, 'chat/completions', chat()),
                                   (completion_params, 'completions', completion())]:
        required = {'model', 'messages', 'prompt'}
        nulls = {name: None for name in sdk_fields(params) - required}
        nulls['max_tokens' if endpoint == 'completions' else 'max_completion_tokens'] = 2
        r = post(server, endpoint, {**body, **nulls})
        assert r.status_code == 200, (endpoint, r.text[:300])

def test_max_completion_tokens_is_honoured(server):
    r = post(server, 'chat/completions', {**chat(ignore_eos=True), 'max_tokens': None, 'max_completion_tokens': 3})
    assert r.status_code == 200 and r.json()['usage']['completion_tokens'] == 3, r.text[:300]

def test_a_field_no_api_defines_is_refused_by_name(server):
    assert refused_param(post(server, 'chat/completions', chat(temprature=0.5))) == 'temprature'
    assert refused_param(post(server, 'chat/completions', chat(temprature=None))) == 'temprature'

WEATHER = {'name': 'get_weather', 'description': 'The weather in a city',
           'parameters': {'type': 'object', 'required': ['city'],      # short enough for random weights to finish
                          'properties': {'city': {'type': 'string', 'pattern': '^[A-Za-z]{1,10}$'}}}}

def test_suffix_is_accepted_and_ignored(server):
    r = post(server, 'completions', completion(suffix='!', temperature=0, ignore_eos=True))
    assert r.status_code == 200, r.text[:300]
    plain = post(server, 'completions', completion(temperature=0, ignore_eos=True)).json()
    assert r.json()['choices'][0]['text'] == plain['choices'][0]['text']

def test_functions_and_function_call_are_tools_and_tool_choice(server):
    "Chat's older fields are honoured as their newer forms: a forced call comes back as `tool_calls`."
    body = chat(functions=[WEATHER], function_call={'name': 'get_weather'}, max_tokens=120,
                temperature=0)
    r = post(server, 'chat/completions', body)
    assert r.status_code == 200, r.text[:300]
    calls = r.json()['choices'][0]['message']['tool_calls']
    assert [call['function']['name'] for call in calls] == ['get_weather']
    newer = chat(tools=[{'type': 'function', 'function': WEATHER}],
                 tool_choice={'type': 'function', 'function': {'name': 'get_weather'}}, max_tokens=120,
                 temperature=0)
    newer_calls = post(server, 'chat/completions', newer).json()['choices'][0]['message']['tool_calls']
    assert [c['function'] for c in calls] == [c['function'] for c in newer_calls]    # the same call (ids are random)
    none = post(server, 'chat/completions', chat(functions=[WEATHER], function_call='none', temperature=0))
    assert none.status_code == 200 and not none.json()['choices'][0]['message'].get('tool_calls'), none.text[:300]

def test_both_forms_of_one_field_are_refused(server):
    tool = {'type': 'function', 'function': WEATHER}
    assert refused_param(post(server, 'chat/completions', chat(functions=[WEATHER], tools=[tool]))) == 'functions'
    both = chat(tools=[tool], function_call='auto', tool_choice='auto')
    assert refused_param(post(server, 'chat/completions', both)) == 'function_call'

# -- best_of ---------------------------------------------------------------------------------------------------------
def logprob_sum(choice: dict) -> float: return sum(choice['logprobs']['token_logprobs'])

def test_best_of_returns_the_n_candidates_with_the_highest_logprob_sum(server):
    "Choice k of a seeded request is seeded seed + k, so `n: 3` with the same seed shows the three candidates."
    sampled = dict(max_tokens=4, ignore_eos=True, temperature=1.5, seed=11, logprobs=0)
    candidates = post(server, 'completions', completion(n=3, **sampled)).json()
    best = post(server, 'completions', completion(n=2, best_of=3, **sampled))
    assert best.status_code == 200, best.text[:300]
    ranked = sorted(candidates['choices'], key=logprob_sum, reverse=True)[:2]
    got = best.json()['choices']
    assert [c['index'] for c in got] == [0, 1]
    assert [(c['text'], logprob_sum(c)) for c in got] == [(c['text'], logprob_sum(c)) for c in ranked]
    assert best.json()['usage']['completion_tokens'] == candidates['usage']['completion_tokens'] == 12

def test_best_of_without_logprobs_answers_without_them(server):
    body = completion(prompt=['Hello', 'World'], n=1, best_of=2, max_tokens=3, ignore_eos=True, seed=3)
    r = post(server, 'completions', body)
    assert r.status_code == 200, r.text[:300]
    assert [(c['index'], c['logprobs']) for c in r.json()['choices']] == [(0, None), (1, None)]
    assert r.json()['usage']['completion_tokens'] == 2 * 2 * 3

def test_best_of_below_n_or_streamed_or_too_many_is_refused(server):
    for body, words in [(completion(n=3, best_of=2), 'best_of must be at least n'),
                        (completion(best_of=2, stream=True), 'cannot be streamed'),
                        (completion(best_of=MAX_N + 1), f'best_of must be <= {MAX_N}')]:
        r = post(server, 'completions', body)
        assert refused_param(r) == 'best_of' and words in r.json()['error']['message'], r.text[:300]
