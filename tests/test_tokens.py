"""`/tokenize`, `/detokenize` and `/version` (chapter 14i), `chat_template_kwargs` and `--reasoning-parser` (chapter
14c), through a real server on a tiny model: the token ids equal the Hugging Face tokenizer's and the chat template's,
the count equals what a chat request is prefilled with, and a reply's thinking is split from its answer exactly where
the model's raw text puts the tags."""
import json, re
import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer
from nanoserve import __version__
from nanoserve.testing import ServerProcess, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=256, max_num_batched_tokens=64)
# The tiny model's template, plus what Qwen3's does with `enable_thinking=False`: an empty thought in the prompt.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")
MESSAGES = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'The capital of France is'}]

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    with ServerProcess(model_dir, served_model_name='tiny', chat_template=TEMPLATE, reasoning_parser='qwen3',
                       **ENGINE) as s: yield s

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60)

@pytest.fixture(scope='module')
def tok(model_dir): return AutoTokenizer.from_pretrained(model_dir)

def post(server, path: str, body: dict) -> httpx.Response: return httpx.post(server.url + path, json=body, timeout=60)

def chat_ids(tok, messages, **kwargs) -> list[int]:
    "The chat template's ids, as transformers renders and tokenizes them."
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False).input_ids

def test_tokenize_a_prompt_equals_the_tokenizer(server, tok):
    prompt = 'The capital of France is Paris, and <s> stays text.'
    r = post(server, '/tokenize', {'model': 'tiny', 'prompt': prompt, 'return_token_strs': True}).json()
    assert r['tokens'] == tok(prompt).input_ids
    assert r['count'] == len(r['tokens']) and r['max_model_len'] == 512
    assert r['token_strs'] == tok.convert_ids_to_tokens(r['tokens'])
    bare = post(server, '/tokenize', {'prompt': prompt, 'add_special_tokens': False}).json()
    assert bare['tokens'] == tok(prompt, add_special_tokens=False).input_ids and bare['token_strs'] is None

def test_tokenize_messages_equals_the_chat_template_and_the_prefill(server, client, tok):
    r = post(server, '/tokenize', {'messages': MESSAGES}).json()
    assert r['tokens'] == chat_ids(tok, MESSAGES)
    reply = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == r['count']

def test_chat_template_kwargs_reach_the_template(server, client, tok):
    kwargs = {'enable_thinking': False}
    r = post(server, '/tokenize', {'messages': MESSAGES, 'chat_template_kwargs': kwargs}).json()
    assert r['tokens'] == chat_ids(tok, MESSAGES, **kwargs) != chat_ids(tok, MESSAGES)
    reply = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=1,
                                           extra_body={'chat_template_kwargs': kwargs})
    assert reply.usage.prompt_tokens == r['count']
    refused = post(server, '/v1/chat/completions', {'messages': MESSAGES, 'chat_template_kwargs': {'tokenize': True}})
    assert refused.status_code == 400 and refused.json()['error']['param'] == 'chat_template_kwargs'

def test_detokenize_round_trips(server, tok):
    text = 'Paris is the capital of France.'
    ids = tok(text, add_special_tokens=False).input_ids
    assert post(server, '/detokenize', {'model': 'tiny', 'tokens': ids}).json() == {'prompt': text}
    with_bos = post(server, '/tokenize', {'prompt': text}).json()['tokens']
    assert post(server, '/detokenize', {'tokens': with_bos}).json()['prompt'] == tok.decode(with_bos)

def test_version_and_refusals(server):
    assert httpx.get(server.url + '/version').json() == {'version': __version__}
    for path, body, param in [('/detokenize', {'tokens': [10**6]}, 'tokens'), ('/detokenize', {'tokens': 'a'}, 'tokens'),
                              ('/tokenize', {}, 'prompt'), ('/tokenize', {'messages': 'hi'}, 'messages'),
                              ('/tokenize', {'model': 'other', 'prompt': 'x'}, 'model'),
                              ('/detokenize', {'tokens': [10**30]}, 'tokens'), ('/tokenize', {'prompt': '\ud800'}, 'prompt')]:
        r = httpx.post(server.url + path, content=json.dumps(body), headers={'Content-Type': 'application/json'})  # \u escapes
        assert 400 <= r.status_code < 500 and r.json()['error']['param'] == param, (path, body, r.text)
    assert httpx.get(server.url + '/debug/state').json()['open_requests'] == 0   # a refusal leaves nothing open

THOUGHT = r'<think>[a-z]{3,12}</think>[A-Z][a-z]{2,8}'   # the model must write its thinking in tags, then answer

def test_reasoning_is_split_where_the_raw_text_puts_the_tags(server, client):
    "A grammar makes the model think in tags; its raw text (completions, same prompt) is thought + tags + answer."
    forced = {'structured_outputs': {'regex': THOUGHT}}
    reply = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=40, temperature=0,
                                           extra_body=forced).choices[0].message
    thought, answer = reply.model_extra['reasoning_content'], reply.content
    prompt = post(server, '/tokenize', {'messages': MESSAGES}).json()['tokens']
    raw = client.completions.create(model='tiny', prompt=prompt, max_tokens=40, temperature=0, extra_body=forced)
    assert raw.choices[0].text == f'<think>{thought}</think>{answer}'
    assert re.fullmatch(THOUGHT, raw.choices[0].text)
    thought_deltas, answer_deltas = [], []
    for chunk in client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=40, temperature=0,
                                                extra_body=forced, stream=True):
        if not chunk.choices: continue
        delta = chunk.choices[0].delta
        thought_deltas.append((delta.model_extra or {}).get('reasoning_content') or '')
        answer_deltas.append(delta.content or '')
    assert (''.join(thought_deltas), ''.join(answer_deltas)) == (thought, answer)
    assert sum(map(bool, thought_deltas)) > 1       # the thinking streamed as it came, not in one piece at the end

def test_a_reply_without_tags_is_all_answer(server, client):
    reply = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=8, temperature=0,
                                           extra_body={'structured_outputs': {'regex': '[A-Z][a-z]{2,8}'}})
    message = reply.choices[0].message
    assert message.content and 'reasoning_content' not in (message.model_extra or {})
