"""Structured outputs and tool calling through the server, driven by the official `openai` client: on a tiny model with
random weights (a grammar must hold whatever the weights, with the overlap loop on), and on SmolLM2 (slow: set
NANOSERVE_SLOW=1). Loopback only; every wait is bounded."""
import json, re
import httpx
import pytest
from openai import OpenAI
from nanoserve.testing import save_tiny_model
from nanoserve.testing import ServerProcess

pytest.importorskip('xgrammar')    # the optional extra nanoserve[structured]

ENGINE = dict(device='cpu', page_size=4, num_pages=1024, enable_overlap=True)
PERSON = {'type': 'object', 'properties': {'name': {'type': 'string', 'pattern': '^[a-z ]{1,8}$'},
                                           'age': {'type': 'integer', 'minimum': 0, 'maximum': 120},
                                           'tags': {'type': 'array', 'items': {'enum': ['red', 'green']}, 'maxItems': 2}},
          'required': ['name', 'age', 'tags']}
WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city',
           'parameters': {'type': 'object', 'properties': {'city': {'type': 'string', 'pattern': '^[A-Za-z]{1,10}$'},
                                                           'unit': {'enum': ['celsius', 'fahrenheit']}},
                          'required': ['city', 'unit']}}}
CLOCK = {'type': 'function', 'function': {'name': 'get_time', 'parameters': {
         'type': 'object', 'properties': {'zone': {'enum': ['UTC', 'CET']}}, 'required': ['zone']}}}
ASK = [{'role': 'user', 'content': 'What is the weather in Paris?'}]

def _person(text: str):
    "The parsed object, asserting it follows PERSON."
    value = json.loads(text)
    assert set(value) == {'name', 'age', 'tags'} and re.fullmatch('[a-z ]{1,8}', value['name']), value
    assert 0 <= value['age'] <= 120 and set(value['tags']) <= {'red', 'green'} and len(value['tags']) <= 2, value
    return value

def _weather_args(arguments: str):
    value = json.loads(arguments)
    assert set(value) == {'city', 'unit'} and re.fullmatch('[A-Za-z]{1,10}', value['city']) and value['unit'] in ('celsius', 'fahrenheit')
    return value

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True, max_position_embeddings=2048)
    with ServerProcess(str(path), served_model_name='tiny', **ENGINE) as s: yield s

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=120)

def test_json_schema_holds_with_random_weights(client):
    "response_format json_schema, strict or not, for chat and completions, greedy and sampled, with n, penalties, seeds."
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON, 'strict': True}}
    r = client.chat.completions.create(model='tiny', messages=ASK, response_format=fmt, max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == 'stop'
    _person(r.choices[0].message.content)
    loose = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
    r = client.chat.completions.create(model='tiny', messages=ASK, response_format=loose, max_tokens=80, n=3,
                                       temperature=1.0, seed=5, presence_penalty=1.0, frequency_penalty=0.5)
    assert [c.finish_reason for c in r.choices] == ['stop'] * 3
    for c in r.choices: _person(c.message.content)
    r = client.completions.create(model='tiny', prompt='Numbers: 0 1 2', max_tokens=80, temperature=0.7,
                                  extra_body={'response_format': fmt, 'repetition_penalty': 1.3})
    _person(r.choices[0].text)

def test_json_schema_streamed_beside_free_text(client):
    "A streamed constrained reply, while free requests run in the same batches."
    free = [client.completions.create(model='tiny', prompt=p, max_tokens=24, stream=True, extra_body={'ignore_eos': True})
            for p in ('Colours:', 'def main():')]
    stream = client.chat.completions.create(model='tiny', messages=ASK, max_tokens=80, temperature=0, stream=True,
                                            response_format={'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': PERSON}})
    text = ''.join(chunk.choices[0].delta.content or '' for chunk in stream if chunk.choices)
    for s in free:    # the free streams ran beside it and end as free text does: 24 tokens, by length
        finishes = [c.choices[0].finish_reason for c in s if c.choices and c.choices[0].finish_reason]
        assert finishes == ['length'], finishes
    _person(text)

def test_vllm_structured_outputs_and_guided_names(client):
    "vLLM's structured_outputs extra (json, regex, choice, grammar) and the older guided_* names."
    def complete(extra, prompt='The capital of France is'):
        return client.completions.create(model='tiny', prompt=prompt, max_tokens=40, temperature=0.9, seed=3,
                                         extra_body=extra).choices[0]
    _person(complete({'structured_outputs': {'json': PERSON}}).text)
    _person(complete({'guided_json': PERSON}).text)
    assert re.fullmatch('[a-z]{2,5}-[0-9]{3}', complete({'structured_outputs': {'regex': '[a-z]{2,5}-[0-9]{3}'}}).text)
    assert re.fullmatch('[0-9]{4}', complete({'guided_regex': '[0-9]{4}'}).text)
    assert complete({'structured_outputs': {'choice': ['yes', 'no', 'maybe']}}).text in ('yes', 'no', 'maybe')
    assert complete({'guided_choice': ['left', 'right']}).text in ('left', 'right')
    text = complete({'structured_outputs': {'grammar': 'root ::= "(" root ")" | "x"'}}).text
    assert re.fullmatch(r'\(*x\)*', text) and text.count('(') == text.count(')')
    assert re.fullmatch('(ab)+', complete({'guided_grammar': 'root ::= "ab" root | "ab"'}).text)

def test_stop_strings_and_length(client):
    "A stop string ends a constrained reply like any other; max_tokens cuts it short with finish_reason 'length'."
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': PERSON}}
    whole = client.chat.completions.create(model='tiny', messages=ASK, response_format=fmt, max_tokens=80, temperature=0)
    stopped = client.chat.completions.create(model='tiny', messages=ASK, response_format=fmt, max_tokens=80, temperature=0,
                                             stop=['"age"'])
    assert stopped.choices[0].finish_reason == 'stop' and whole.choices[0].message.content.startswith(stopped.choices[0].message.content)
    cut = client.chat.completions.create(model='tiny', messages=ASK, response_format=fmt, max_tokens=4, temperature=0)
    assert cut.choices[0].finish_reason == 'length' and whole.choices[0].message.content.startswith(cut.choices[0].message.content)

@pytest.mark.parametrize('change,param,words', [
    ({'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'objekt'}}}}, 'response_format', 'invalid JSON schema'),
    ({'response_format': {'type': 'xml'}}, 'response_format', 'type'),
    ({'structured_outputs': {'regex': '[a-'}}, 'structured_outputs', 'invalid regex'),
    ({'structured_outputs': {'grammar': 'root ::= ('}}, 'structured_outputs', 'invalid grammar'),
    ({'structured_outputs': {'yaml': 'a: b'}}, 'structured_outputs', 'yaml'),
    ({'guided_json': '{"type": '}, 'guided_json', 'invalid JSON schema'),
    ({'guided_regex': '(a'}, 'guided_regex', 'invalid regex'),
    ({'guided_choice': []}, 'guided_choice', 'choice'),
    ({'guided_grammar': 'root ::= '}, 'guided_grammar', 'invalid grammar'),
    ({'guided_regex': 'a', 'guided_choice': ['a']}, 'guided_choice', 'only one'),
    ({'tools': [{'type': 'function'}]}, 'tools', 'tools'),
    ({'tools': [WEATHER], 'tool_choice': {'type': 'function', 'function': {'name': 'nope'}}}, 'tool_choice', 'names no function'),
    ({'tool_choice': 'required'}, 'tool_choice', 'needs tools'),
    ({'tools': [WEATHER], 'tool_choice': 'required', 'response_format': {'type': 'json_object'}}, 'response_format', 'tool_choice'),
])
def test_bad_grammar_is_400_naming_the_field(server, change, param, words):
    r = httpx.post(f'{server.url}/v1/chat/completions', json={'model': 'tiny', 'messages': ASK, 'max_tokens': 4, **change}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()['error']
    assert error['param'] == param and words in error['message'], error

def test_tool_choice_required_and_named(client):
    "Enforced calls: a valid call even from random weights, with finish_reason 'tool_calls'."
    r = client.chat.completions.create(model='tiny', messages=ASK, tools=[WEATHER, CLOCK], tool_choice='required',
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert len(choice.message.tool_calls or []) == 1, choice
    assert choice.finish_reason == 'tool_calls' and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == 'function' and call.id.startswith('call_') and call.function.name in ('get_weather', 'get_time')
        args = json.loads(call.function.arguments)
        if call.function.name == 'get_weather': _weather_args(call.function.arguments)
        else: assert args in ({'zone': 'UTC'}, {'zone': 'CET'})
    named = {'type': 'function', 'function': {'name': 'get_weather'}}
    r = client.chat.completions.create(model='tiny', messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                       max_tokens=60, temperature=0.8, n=2)
    for choice in r.choices:
        assert choice.finish_reason == 'tool_calls' and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ['get_weather']
        _weather_args(choice.message.tool_calls[0].function.arguments)

def test_tool_calls_streamed_as_openai_deltas(client):
    named = {'type': 'function', 'function': {'name': 'get_weather'}}
    stream = client.chat.completions.create(model='tiny', messages=ASK, tools=[WEATHER], tool_choice=named,
                                            max_tokens=60, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id.startswith('call_') and calls[0].type == 'function' and calls[0].function.name == 'get_weather'
    assert calls[0].function.arguments == '' and all(d.index == 0 for d in calls)
    _weather_args(''.join(d.function.arguments or '' for d in calls))
    assert chunks[-1].choices[0].finish_reason == 'tool_calls'
    assert not ''.join(c.choices[0].delta.content or '' for c in chunks)

def test_tool_results_in_history_and_auto(client):
    "A conversation with a call and its result goes back to the model; 'auto' and 'none' answer, with or without calls."
    first = client.chat.completions.create(model='tiny', messages=ASK, tools=[WEATHER], tool_choice='required', max_tokens=80,
                                           parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{'role': 'assistant', 'content': None, 'tool_calls': [call.model_dump()]},
                     {'role': 'tool', 'tool_call_id': call.id, 'content': json.dumps({'temperature': 21})}]
    for choice in ('auto', 'none'):
        r = client.chat.completions.create(model='tiny', messages=history, tools=[WEATHER], tool_choice=choice, max_tokens=8)
        message = r.choices[0].message
        assert r.choices[0].finish_reason in ('stop', 'length', 'tool_calls')
        assert message.tool_calls or message.content is not None
    r = client.chat.completions.create(model='tiny', messages=history, tools=[WEATHER], max_tokens=8, stream=True)
    assert [c for c in r if c.choices][-1].choices[0].finish_reason in ('stop', 'length', 'tool_calls')

def test_tensor_parallel_grammar_on_rank_0(tmp_path):
    "With TP 2, rank 0 samples under the grammar: the same tokens as TP 1, greedy and seeded, n=2."
    from nanoserve.llm import LLM
    from nanoserve.req import SamplingParams, StructuredOutputsParams
    path = str(save_tiny_model(tmp_path / 'tiny', 'llama', tokenizer=True))
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=PERSON)),
              SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=64, structured_outputs={'regex': '[a-z]{2,5}-[0-9]{3}'})]
    outs = {}
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, device='cpu', page_size=4, num_pages=64) as llm:
            outs[tp] = [[(c.token_ids, c.text) for c in o.outputs] for o in llm.generate(['The quick brown fox', 'Paris is'], params, use_tqdm=False)]
    assert outs[1] == outs[2]
    _person(outs[2][0][0][1])
    assert all(re.fullmatch('[a-z]{2,5}-[0-9]{3}', text) for _, text in outs[2][1])

# -- a real model ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def smol():
    from nanoserve.checkpoints import resolve_model      # SmolLM2-135M-Instruct, converted once (chapter 14z)
    with ServerProcess(str(resolve_model('smollm2')), served_model_name='smollm2', device='cpu', enable_overlap=True) as s:
        yield OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=300)

@pytest.mark.slow
def test_smollm2_structured_and_tools(smol):
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
    r = smol.chat.completions.create(model='smollm2', messages=[{'role': 'user', 'content': 'Describe a person as JSON.'}],
                                     response_format=fmt, max_tokens=80, temperature=0)
    _person(r.choices[0].message.content)
    r = smol.chat.completions.create(model='smollm2', messages=[{'role': 'user', 'content': 'Give me a JSON object about Paris.'}],
                                     response_format={'type': 'json_object'}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == 'stop': assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = smol.chat.completions.create(model='smollm2', messages=ASK, tools=[WEATHER, CLOCK], tool_choice='required',
                                     parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == 'tool_calls'
    _weather_args(next(c for c in r.choices[0].message.tool_calls if c.function.name == 'get_weather').function.arguments) \
        if any(c.function.name == 'get_weather' for c in r.choices[0].message.tool_calls) else None
