"""`POST /v1/responses` (chapter 14g) through the official `openai` SDK and the OpenAI Agents SDK, against a real server
on a tiny model with random weights: each greedy answer equals the chat route's for the same messages, streamed or
not, with a forced function call, a `function_call_output` round trip, `previous_response_id`, `text.format`; and the
400s that name a bad field."""
import asyncio, json, re
import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from nanoserve.testing import ServerProcess, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=512, max_num_batched_tokens=64)
GREEDY = dict(model='tiny', temperature=0)
CITY = {'type': 'object', 'properties': {'city': {'type': 'string', 'pattern': '^[A-Za-z]{1,10}$'},
                                         'unit': {'enum': ['celsius', 'fahrenheit']}},
        'required': ['city', 'unit']}
WEATHER = {'type': 'function', 'name': 'get_weather', 'description': 'The weather in a city', 'parameters': CITY}
CHAT_WEATHER = {'type': 'function', 'function': {k: v for k, v in WEATHER.items() if k != 'type'}}
ASK = 'What is the weather in Paris?'

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True,
                           max_position_embeddings=2048)
    with ServerProcess(str(path), served_model_name='tiny', **ENGINE) as s: yield s

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=120)

def chat(client, messages: list[dict], max_tokens: int, **kw):
    "The chat route's greedy answer to the same messages: its first choice, and its usage."
    r = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kw)
    return r.choices[0], r.usage

def check_weather_args(arguments: str):
    value = json.loads(arguments)
    assert set(value) == {'city', 'unit'} and re.fullmatch('[A-Za-z]{1,10}', value['city']), value
    assert value['unit'] in ('celsius', 'fahrenheit'), value

def test_plain_equals_chat(client):
    r = client.responses.create(input='Hello there', instructions='Be brief.', max_output_tokens=8, **GREEDY)
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hello there'}]
    choice, usage = chat(client, messages, 8)
    assert r.object == 'response' and r.id.startswith('resp_') and r.model == 'tiny'
    assert r.output_text == choice.message.content
    assert [item.type for item in r.output] == ['message'] and r.output[0].id.startswith('msg_')
    assert (r.status == 'incomplete') == (choice.finish_reason == 'length')
    if r.status == 'incomplete': assert r.incomplete_details.reason == 'max_output_tokens'
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == ('Be brief.', 8, 0, True)

def test_streamed_events_in_order_and_equal_text(client):
    plain = client.responses.create(input='Tell me a story', max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(input='Tell me a story', max_output_tokens=10, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text_events = ['response.output_text.delta'] * kinds.count('response.output_text.delta')
    assert kinds == ['response.created', 'response.in_progress', 'response.output_item.added',
                     'response.content_part.added', *text_events, 'response.output_text.done',
                     'response.content_part.done', 'response.output_item.done', f'response.{plain.status}']
    streamed = ''.join(e.delta for e in events if e.type == 'response.output_text.delta')
    assert streamed == plain.output_text == events[-1].response.output_text
    assert [e.text for e in events if e.type == 'response.output_text.done'] == [streamed] and \
        events[-1].response.usage.output_tokens == plain.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, 'item_id')}
    assert item_ids == {events[-1].response.output[0].id}
    with client.responses.stream(input='Tell me a story', max_output_tokens=10, **GREEDY) as stream:
        helper_events = list(stream)       # `get_final_response` wants `response.completed`: this one may be cut
    helper_text = ''.join(e.delta for e in helper_events if e.type == 'response.output_text.delta')
    assert helper_events[-1].type == f'response.{plain.status}'
    assert helper_text == helper_events[-1].response.output_text == plain.output_text

def test_forced_function_call_equals_chat(client):
    pytest.importorskip('xgrammar')
    forced = dict(tools=[WEATHER], tool_choice={'type': 'function', 'name': 'get_weather'}, max_output_tokens=60)
    r = client.responses.create(input=ASK, **forced, **GREEDY)
    assert [item.type for item in r.output] == ['function_call'] and r.output_text == ''
    call = r.output[0]
    assert call.id.startswith('fc_') and call.name == 'get_weather' and call.status == 'completed'
    check_weather_args(call.arguments)
    choice, _ = chat(client, [{'role': 'user', 'content': ASK}], 60, tools=[CHAT_WEATHER],
                     tool_choice={'type': 'function', 'function': {'name': 'get_weather'}})
    assert choice.message.tool_calls[0].function.arguments == call.arguments
    events = list(client.responses.create(input=ASK, stream=True, **forced, **GREEDY))
    streamed = ''.join(e.delta for e in events if e.type == 'response.function_call_arguments.delta')
    done = [e for e in events if e.type == 'response.function_call_arguments.done']
    assert streamed == done[0].arguments == call.arguments
    assert [item.type for item in events[-1].response.output] == ['function_call']

def test_function_call_output_round_trip(client):
    pytest.importorskip('xgrammar')
    first = client.responses.create(input=ASK, tools=[WEATHER], tool_choice='required', parallel_tool_calls=False,
                                    max_output_tokens=80, **GREEDY)
    call = first.output[0]
    items = [{'role': 'user', 'content': ASK},
             {'type': 'function_call', 'call_id': call.call_id, 'name': call.name, 'arguments': call.arguments},
             {'type': 'function_call_output', 'call_id': call.call_id, 'output': '{"temperature": 21}'}]
    r = client.responses.create(input=items, tools=[WEATHER], tool_choice='none', max_output_tokens=8, **GREEDY)
    chat_call = {'id': call.call_id, 'type': 'function', 'function': {'name': call.name, 'arguments': call.arguments}}
    history = [{'role': 'user', 'content': ASK}, {'role': 'assistant', 'content': None, 'tool_calls': [chat_call]},
               {'role': 'tool', 'tool_call_id': call.call_id, 'content': '{"temperature": 21}'}]
    choice, usage = chat(client, history, 8, tools=[CHAT_WEATHER], tool_choice='none')
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens
    followed = client.responses.create(input=items[2:], previous_response_id=first.id, tools=[WEATHER],
                                       tool_choice='none', max_output_tokens=8, **GREEDY)   # the call, stored
    assert followed.output_text == r.output_text and followed.usage.input_tokens == r.usage.input_tokens

def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input='Hi', instructions='Answer in French.', max_output_tokens=6, **GREEDY)
    second = client.responses.create(input='Tell me more', previous_response_id=first.id, max_output_tokens=6,
                                     **GREEDY)
    history = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': first.output_text},
               {'role': 'user', 'content': 'Tell me more'}]         # the first request's instructions are not carried
    choice, usage = chat(client, history, 6)
    assert second.output_text == choice.message.content and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError): client.responses.retrieve(first.id)

def test_unstored_response_cannot_be_continued(client):
    r = client.responses.create(input='Hi', store=False, max_output_tokens=4, **GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input='More', previous_response_id=r.id, max_output_tokens=4, **GREEDY)
    assert refused.value.body['param'] == 'previous_response_id' and r.id in refused.value.body['message']
    with pytest.raises(openai.NotFoundError): client.responses.retrieve(r.id)

def test_text_format_json_schema(client):
    pytest.importorskip('xgrammar')
    fmt = {'format': {'type': 'json_schema', 'name': 'city', 'schema': CITY, 'strict': True}}
    r = client.responses.create(input=ASK, text=fmt, max_output_tokens=60, **GREEDY)
    check_weather_args(r.output_text)
    choice, _ = chat(client, [{'role': 'user', 'content': ASK}], 60,
                     response_format={'type': 'json_schema', 'json_schema': {'name': 'city', 'schema': CITY}})
    assert r.output_text == choice.message.content and r.text.format.type == 'json_schema'
    assert r.status == 'completed'                      # the grammar ends the reply: the stream helper's final response
    with client.responses.stream(input=ASK, text=fmt, max_output_tokens=60, **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text

@pytest.mark.parametrize('body, param', [
    ({'input': 'Hi', 'frobnicate': 1}, 'frobnicate'),
    ({'input': 'Hi', 'background': True}, 'background'),
    ({}, 'input'),
    ({'input': [{'type': 'input_image', 'image_url': 'http://x'}]}, 'input'),
    ({'input': [{'role': 'user', 'content': [{'type': 'input_file', 'file_id': 'f'}]}]}, 'input'),
    ({'input': 'Hi', 'tools': [{'type': 'web_search'}]}, 'tools'),
    ({'input': 'Hi', 'tools': [WEATHER], 'tool_choice': {'type': 'function', 'name': 'nope'}}, 'tool_choice'),
    ({'input': 'Hi', 'max_output_tokens': 0}, 'max_output_tokens'),
    ({'input': 'Hi', 'temperature': -1}, 'temperature'),
    ({'input': 'Hi', 'text': {'format': {'type': 'yaml'}}}, 'text'),
    ({'input': 'Hi', 'previous_response_id': 'resp_nothing'}, 'previous_response_id'),
    ({'input': 'Hi', 'temperature': float('inf')}, 'temperature'),                 # echoed: JSON cannot say it
    ({'input': 'Hi', 'metadata': {'a': '\ud800'}}, 'metadata'),                     # echoed: not valid Unicode
    ({'input': 'Hi', 'metadata': {f'k{i}': 'v' for i in range(17)}}, 'metadata'),  # OpenAI's bound: 16 pairs
    ({'input': 'Hi', 'metadata': {'k': 'v' * 513}}, 'metadata'),                   # ... values of 512 characters
    ({'input': 'Hi', 'text': {'junk': 'z'}}, 'text'),
    ({'input': 'Hi', 'tools': [{**WEATHER, 'description': float('nan')}]}, 'tools'),
    ({'input': [{'role': 'user', 'content': [{'type': 'input_text', 'text': None}]}]}, 'input'),
    ({'input': [{'role': 'user', 'content': [{'type': 'input_text', 'text': {'a': 1}}]}]}, 'input'),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    sent = json.dumps({'model': 'tiny', **body})    # \u escapes and Infinity, as a lax client may send them
    r = httpx.post(f'{server.url}/v1/responses', content=sent, headers={'Content-Type': 'application/json'}, timeout=60)
    assert r.status_code == 400 and r.json()['error']['param'] == param, r.text
    streamed = httpx.post(f'{server.url}/v1/responses', content=json.dumps({'model': 'tiny', 'stream': True, **body}),
                          headers={'Content-Type': 'application/json'}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()['error']['param'] == param, streamed.text

def test_agents_sdk_runs_on_the_server(server, client):
    """An OpenAI Agents SDK `Agent` on `OpenAIResponsesModel`: its final output is the Responses route's greedy answer.
    The SDK treats an incomplete response as a failure, so the agent answers in a JSON schema whose grammar ends the
    reply (random weights never choose to stop)."""
    pytest.importorskip('xgrammar')
    pytest.importorskip('agents')
    from typing import Literal
    from pydantic import BaseModel
    from agents import Agent, AgentOutputSchema, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    class Forecast(BaseModel):
        city: Literal['Paris', 'Rome']
        unit: Literal['celsius', 'fahrenheit']
    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model='tiny', openai_client=AsyncOpenAI(base_url=server.url + '/v1', api_key='unused',
                                                                         max_retries=0, timeout=120))
    agent = Agent(name='helper', instructions='Be brief.', model=model, output_type=Forecast,
                  model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = asyncio.run(Runner.run(agent, ASK))
    schema = AgentOutputSchema(Forecast).json_schema()         # what the SDK sends as text.format
    fmt = {'format': {'type': 'json_schema', 'name': 'final_output', 'schema': schema, 'strict': True}}
    expected = client.responses.create(input=ASK, instructions='Be brief.', text=fmt, max_output_tokens=60, **GREEDY)
    assert expected.status == 'completed'
    assert result.final_output == Forecast.model_validate_json(expected.output_text)
    assert result.raw_responses[-1].output[-1].content[0].text == expected.output_text
