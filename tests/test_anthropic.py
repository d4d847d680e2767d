"""Anthropic's Messages API (chapter 14h) through the official `anthropic` SDK and LangChain's `ChatAnthropic`,
against a real server on a tiny model with an API key: the greedy text, plain and streamed, is the text the same
server's chat completions give (the `openai` SDK); stop sequences, `max_tokens`, a forced tool and a tool result
round trip, `count_tokens`, the prefix cache in the usage, the thinking split off by a reasoning parser, an error
midway through a stream, and the 400s and 401 in Anthropic's envelope."""
import json
import anthropic
import httpx
import pytest
from openai import OpenAI
from nanoserve.testing import ServerProcess, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=256, max_num_batched_tokens=16)
KEY = 'sk-test'
GREEDY = {'temperature': 0}          # neither SDK's `create` takes a temperature: it goes in the body as it is
SYSTEM = 'You answer in one short sentence.'
HELLO = [{'role': 'user', 'content': 'Hello, who are you?'}]
WEATHER_TOOL = {'name': 'get_weather', 'description': 'The weather in a city, in degrees Celsius',
                'input_schema': {'type': 'object', 'properties': {'city': {'enum': ['Paris', 'Rome', 'Oslo']},
                                                                   'celsius': {'type': 'boolean'}},
                                 'required': ['city', 'celsius'], 'additionalProperties': False}}

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True,
                               max_position_embeddings=2048))   # room for a conversation with tools

@pytest.fixture(scope='module')
def server(model_dir):
    with ServerProcess(model_dir, served_model_name='tiny', api_key=KEY, debug_hooks=True, **ENGINE) as s: yield s

@pytest.fixture(scope='module')
def claude(server): return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)

@pytest.fixture(scope='module')
def gpt(server): return OpenAI(base_url=server.url + '/v1', api_key=KEY, max_retries=0, timeout=60)

def chat(gpt, messages, max_tokens, system=SYSTEM, **body):
    "The server's chat completion of the same conversation, greedy: its first choice and its usage."
    messages = ([{'role': 'system', 'content': system}] if system else []) + messages
    r = gpt.chat.completions.create(model='tiny', messages=messages, max_tokens=max_tokens, extra_body={**GREEDY, **body})
    return r.choices[0], r.usage

def text_of(message) -> str: return ''.join(b.text for b in message.content if b.type == 'text')

def post(server, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={'x-api-key': key}, timeout=60)

# -- the text, plain and streamed ----------------------------------------------------------------------------------------
def test_text_is_chats(claude, gpt):
    choice, usage = chat(gpt, HELLO, 8)
    m = claude.messages.create(model='tiny', max_tokens=8, system=SYSTEM, messages=HELLO, extra_body=GREEDY)
    assert choice.message.content and text_of(m) == choice.message.content
    assert (m.type, m.role, m.model, m.id[:4]) == ('message', 'assistant', 'tiny', 'msg_')
    assert m.stop_reason == {'length': 'max_tokens', 'stop': 'end_turn'}[choice.finish_reason] and m.stop_sequence is None
    assert m.usage.output_tokens == usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.cache_creation_input_tokens == 0

def test_stream_is_chats(claude, gpt):
    choice, usage = chat(gpt, HELLO, 8)
    with claude.messages.stream(model='tiny', max_tokens=8, system=SYSTEM, messages=HELLO, extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and ''.join(pieces) == text_of(final) == choice.message.content
    assert final.usage.output_tokens == usage.completion_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == usage.prompt_tokens
    events = list(claude.messages.create(model='tiny', max_tokens=8, system=SYSTEM, messages=HELLO, stream=True,
                                         extra_body=GREEDY))
    kinds = [e.type for e in events]                  # the SDK leaves out the pings
    assert kinds[:2] == ['message_start', 'content_block_start'] and kinds[-3:] == [
        'content_block_stop', 'message_delta', 'message_stop'], kinds
    assert set(kinds[2:-3]) == {'content_block_delta'}
    assert ''.join(e.delta.text for e in events if e.type == 'content_block_delta') == choice.message.content
    assert events[-2].delta.stop_reason == final.stop_reason and events[-2].usage.output_tokens == usage.completion_tokens
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens == usage.prompt_tokens

def test_the_events_on_the_wire(server):
    body = {'model': 'tiny', 'max_tokens': 3, 'messages': HELLO, 'stream': True, **GREEDY}
    r = post(server, '/v1/messages', body)
    assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
    lines = [line for line in r.text.split('\n') if line]
    names = [line.removeprefix('event: ') for line in lines[0::2]]
    data = [json.loads(line.removeprefix('data: ')) for line in lines[1::2]]
    assert names == [d['type'] for d in data], lines
    assert names[:3] == ['message_start', 'ping', 'content_block_start'] and names[-1] == 'message_stop', names
    assert data[0]['message']['content'] == [] and data[0]['message']['usage']['output_tokens'] == 0

def test_a_repeated_prompt_is_read_from_the_prefix_cache(claude):
    messages = [{'role': 'user', 'content': 'Tell me a long story about a lighthouse keeper and her cat.'}]
    total = claude.messages.count_tokens(model='tiny', system=SYSTEM, messages=messages).input_tokens
    for _ in range(2): m = claude.messages.create(model='tiny', max_tokens=2, system=SYSTEM, messages=messages,
                                                  extra_body=GREEDY)
    assert m.usage.cache_read_input_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens == total

# -- how it stops ----------------------------------------------------------------------------------------------------------
def test_max_tokens(claude, gpt):
    choice, _ = chat(gpt, HELLO, 5)
    assert choice.finish_reason == 'length'            # this prompt runs on past 5 tokens: the test means something
    m = claude.messages.create(model='tiny', max_tokens=5, system=SYSTEM, messages=HELLO, extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ('max_tokens', None, 5)

def test_stop_sequences(claude, gpt):
    choice, _ = chat(gpt, HELLO, 16)
    text = choice.message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    m = claude.messages.create(model='tiny', max_tokens=16, system=SYSTEM, messages=HELLO, stop_sequences=[stop, '@@@'],
                               extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence, text_of(m)) == ('stop_sequence', stop, text[:text.index(stop)])
    with claude.messages.stream(model='tiny', max_tokens=16, system=SYSTEM, messages=HELLO, stop_sequences=[stop],
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ('stop_sequence', stop, text[:text.index(stop)])

# -- tools -----------------------------------------------------------------------------------------------------------------
ASK = [{'role': 'user', 'content': 'What is the weather in Paris?'}]
FORCED = {'type': 'tool', 'name': 'get_weather'}

def test_forced_tool(claude, gpt):
    m = claude.messages.create(model='tiny', max_tokens=40, messages=ASK, tools=[WEATHER_TOOL], tool_choice=FORCED,
                               extra_body=GREEDY)
    assert m.stop_reason == 'tool_use', m
    [call] = [b for b in m.content if b.type == 'tool_use']
    assert call.name == 'get_weather' and call.id.startswith('toolu_')
    assert set(call.input) == {'city', 'celsius'} and call.input['city'] in ('Paris', 'Rome', 'Oslo')
    assert isinstance(call.input['celsius'], bool)
    tool = {'type': 'function', 'function': {'name': 'get_weather', 'description': WEATHER_TOOL['description'],
                                             'parameters': WEATHER_TOOL['input_schema']}}
    choice, _ = chat(gpt, ASK, 40, system=None, tools=[tool],
                     tool_choice={'type': 'function', 'function': {'name': 'get_weather'}})
    assert json.loads(choice.message.tool_calls[0].function.arguments) == call.input
    with claude.messages.stream(model='tiny', max_tokens=40, messages=ASK, tools=[WEATHER_TOOL], tool_choice=FORCED,
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == 'tool_use']
    assert (final.stop_reason, streamed.name, streamed.input) == ('tool_use', 'get_weather', call.input)

def test_a_call_whose_arguments_are_not_an_object_is_still_a_tool_use(claude):
    "A model may write a call's arguments as a string (here a grammar makes it): Anthropic's `input` is an object."
    call = {'type': 'object', 'properties': {'name': {'const': 'get_weather'}, 'arguments': {'type': 'string',
            'maxLength': 6}}, 'required': ['name', 'arguments'], 'additionalProperties': False}
    forced = dict(GREEDY, output_config={'format': {'type': 'json_schema', 'schema': call}})
    m = claude.messages.create(model='tiny', max_tokens=60, messages=ASK, tools=[WEATHER_TOOL], extra_body=forced)
    [tool_use] = [b for b in m.content if b.type == 'tool_use']
    assert m.stop_reason == 'tool_use' and list(tool_use.input) == ['arguments']
    assert isinstance(tool_use.input['arguments'], str)
    with claude.messages.stream(model='tiny', max_tokens=60, messages=ASK, tools=[WEATHER_TOOL], extra_body=forced) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == 'tool_use'] == [tool_use.input]

def test_tool_result_round_trip(claude, gpt):
    call = {'type': 'tool_use', 'id': 'toolu_0123', 'name': 'get_weather', 'input': {'city': 'Paris', 'celsius': True}}
    result = {'type': 'tool_result', 'tool_use_id': 'toolu_0123', 'content': [{'type': 'text', 'text': '18 degrees'}]}
    messages = ASK + [{'role': 'assistant', 'content': [call]}, {'role': 'user', 'content': [result]}]
    m = claude.messages.create(model='tiny', max_tokens=8, messages=messages, tools=[WEATHER_TOOL], extra_body=GREEDY)
    tool = {'type': 'function', 'function': {'name': 'get_weather', 'description': WEATHER_TOOL['description'],
                                             'parameters': WEATHER_TOOL['input_schema']}}
    openai_messages = ASK + [
        {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'toolu_0123', 'type': 'function', 'function': {
            'name': 'get_weather', 'arguments': json.dumps(call['input'])}}]},
        {'role': 'tool', 'tool_call_id': 'toolu_0123', 'content': '18 degrees'}]
    choice, usage = chat(gpt, openai_messages, 8, system=None, tools=[tool])
    assert text_of(m) == (choice.message.content or '') and m.usage.output_tokens == usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    counted = claude.messages.count_tokens(model='tiny', messages=messages, tools=[WEATHER_TOOL])
    assert counted.input_tokens == usage.prompt_tokens

def test_output_format_is_chats_json_schema(claude, gpt):
    schema = {'type': 'object', 'properties': {'answer': {'enum': ['yes', 'no', 'maybe']}}, 'required': ['answer'],
              'additionalProperties': False}
    m = claude.messages.create(model='tiny', max_tokens=20, system=SYSTEM, messages=HELLO, extra_body=GREEDY,
                               output_config={'format': {'type': 'json_schema', 'schema': schema}})
    assert json.loads(text_of(m))['answer'] in ('yes', 'no', 'maybe') and m.stop_reason == 'end_turn'
    choice, _ = chat(gpt, HELLO, 20, response_format={'type': 'json_schema', 'json_schema': {'name': 'o', 'schema': schema}})
    assert text_of(m) == choice.message.content

def test_count_tokens_is_the_chat_prompt(claude, gpt):
    _, usage = chat(gpt, HELLO, 1)
    assert claude.messages.count_tokens(model='tiny', system=SYSTEM, messages=HELLO).input_tokens == usage.prompt_tokens
    _, bare = chat(gpt, HELLO, 1, system=None)
    assert bare.prompt_tokens < usage.prompt_tokens
    assert claude.messages.count_tokens(model='tiny', messages=HELLO).input_tokens == bare.prompt_tokens

# -- errors ----------------------------------------------------------------------------------------------------------------
def test_wrong_key_is_401_in_anthropics_envelope(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key='sk-wrong', max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model='tiny', max_tokens=4, messages=HELLO)
    assert e.value.status_code == 401 and e.value.body['type'] == 'error'
    assert e.value.body['error']['type'] == 'authentication_error' and e.value.body['error']['message']
    r = post(server, '/v1/messages/count_tokens', {'model': 'tiny', 'messages': HELLO}, key='sk-wrong')
    assert r.status_code == 401 and r.json()['error']['type'] == 'authentication_error'

@pytest.mark.parametrize('body, named', [
    ({'model': 'tiny', 'messages': HELLO}, 'max_tokens'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': [
        {'type': 'image', 'source': {'type': 'base64', 'media_type': 'image/png', 'data': 'iVBORw0KGgo='}}]}]}, 'image'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'system', 'content': 'Hi'}]}, 'role'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'frobnicate': 1}, 'frobnicate'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'temperature': -1}, 'temperature'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'stop_sequences': ['']}, 'stop_sequences'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'tools': [WEATHER_TOOL],
      'tool_choice': {'type': 'tool', 'name': 'nope'}}, 'tool_choice'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'tool_choice': {'type': 'any'}}, "'any' needs tools"),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'tools': [{**WEATHER_TOOL, 'name': ''}]}, 'a name'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': HELLO, 'tools': [WEATHER_TOOL, WEATHER_TOOL]}, 'unique'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': [{'type': 'text'}]}]}, 'needs its text'),
    ({'model': 'tiny', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': []}]}, 'empty')])
def test_bad_input_is_400_invalid_request(server, body, named):
    r = post(server, '/v1/messages', body)
    assert r.status_code == 400 and r.json()['type'] == 'error', r.text
    error = r.json()['error']
    assert error['type'] == 'invalid_request_error' and named in error['message'], error

def test_bad_input_through_the_sdk(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model='tiny', max_tokens=4, messages=[{'role': 'user', 'content': [
            {'type': 'document', 'source': {'type': 'text', 'media_type': 'text/plain', 'data': 'hi'}}]}])
    assert e.value.body['error']['type'] == 'invalid_request_error' and 'document' in e.value.body['error']['message']
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model='other', max_tokens=4, messages=HELLO)

def test_an_error_midway_is_an_error_event(server, claude, gpt):
    choice, _ = chat(gpt, HELLO, 12)
    assert choice.finish_reason == 'length'
    server.inject(fail_detokenize=3)                  # the next request fails once it has more than 3 tokens
    with pytest.raises(anthropic.APIStatusError) as e:
        with claude.messages.stream(model='tiny', max_tokens=12, system=SYSTEM, messages=HELLO, extra_body=GREEDY) as s:
            for _ in s: pass
    assert e.value.body['type'] == 'error' and 'detokeniz' in e.value.body['error']['message'], e.value.body
    assert text_of(claude.messages.create(model='tiny', max_tokens=12, system=SYSTEM, messages=HELLO,
                                          extra_body=GREEDY)) == choice.message.content   # and it serves on

# -- LangChain ---------------------------------------------------------------------------------------------------------------
def test_langchain_chat_anthropic(server, gpt):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, SystemMessage
    model = ChatAnthropic(anthropic_api_url=server.url, api_key=KEY, model='tiny', max_tokens=8, temperature=0,
                          max_retries=0)
    choice, usage = chat(gpt, HELLO, 8)
    messages = [SystemMessage(SYSTEM), HumanMessage(HELLO[0]['content'])]
    answer = model.invoke(messages)
    assert answer.content == choice.message.content
    assert answer.usage_metadata['output_tokens'] == usage.completion_tokens
    assert answer.usage_metadata['input_tokens'] == usage.prompt_tokens
    assert ''.join(c.text for c in model.stream(messages)) == choice.message.content

# -- thinking ----------------------------------------------------------------------------------------------------------------
def test_thinking_blocks_with_a_reasoning_parser(model_dir):
    "With `--reasoning-parser deepseek_r1` a reply is thinking until `</think>`, which this model never writes."
    with ServerProcess(model_dir, served_model_name='tiny', reasoning_parser='deepseek_r1', **ENGINE) as s:
        claude = anthropic.Anthropic(base_url=s.url, api_key='unused', max_retries=0, timeout=60)
        gpt = OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=60)
        choice, _ = chat(gpt, HELLO, 8)
        thought = choice.message.model_extra['reasoning_content']
        assert thought and not choice.message.content
        thinking = {'type': 'enabled', 'budget_tokens': 1024}
        m = claude.messages.create(model='tiny', max_tokens=8, system=SYSTEM, messages=HELLO, thinking=thinking,
                                   extra_body=GREEDY)
        assert [(b.type, b.thinking) for b in m.content] == [('thinking', thought)]
        with claude.messages.stream(model='tiny', max_tokens=8, system=SYSTEM, messages=HELLO, thinking=thinking,
                                    extra_body=GREEDY) as stream:
            kinds = [e.delta.type for e in stream if e.type == 'content_block_delta']
            final = stream.get_final_message()
        assert set(kinds) == {'thinking_delta'} and [(b.type, b.thinking) for b in final.content] == [('thinking', thought)]
