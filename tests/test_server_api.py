"""The parts of the OpenAI and vLLM surface that evaluation and benchmark clients use, through the official `openai`
client against a real server on a tiny model: echo with prompt logprobs (the request shapes lm-eval's
`local-completions` sends, checked against `transformers`), `logit_bias`, `allowed_token_ids`, `bad_words`,
`prompt_logprobs`, `GET /v1/models/{id}`, `stream_options.continuous_usage_stats`, the chat template switches, and
the 400s that name a bad or unknown parameter."""
import httpx
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer
from nanoserve.testing import ServerProcess, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=256, max_num_batched_tokens=16)   # small steps: chunked prompts
PROMPT = 'The capital of France is'

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    with ServerProcess(model_dir, served_model_name='tiny', **ENGINE) as s: yield s

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60)

@pytest.fixture(scope='module')
def tok(model_dir): return AutoTokenizer.from_pretrained(model_dir)

@pytest.fixture(scope='module')
def hf(model_dir): return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    "`transformers`' log-softmax at every position of `ids` (row p scores token p + 1)."
    with torch.no_grad(): return hf(torch.tensor([ids])).logits[0].log_softmax(-1)

def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()

def post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f'{server.url}/v1/{endpoint}', json=body, timeout=60)

def refused(server, endpoint: str, body: dict) -> tuple[int, str | None]:
    "A request's status and the `param` of its OpenAI error envelope."
    r = post(server, endpoint, body)
    error = r.json()['error']
    assert set(error) == {'message', 'type', 'param', 'code'}, error
    return r.status_code, error['param']

def chat_base(**kw) -> dict: return {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 4, **kw}

# -- echo and prompt logprobs -------------------------------------------------------------------------------------------
def test_echo_with_logprobs_matches_transformers(client, tok, hf):
    ids = tok(PROMPT).input_ids
    plain = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=3, temperature=0, extra_body={'ignore_eos': True})
    r = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  extra_body={'ignore_eos': True, 'return_tokens_as_token_ids': True})
    c = r.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 3
    all_ids = [int(t.split(':')[1]) for t in lp.tokens]
    assert all_ids[:len(ids)] == ids and all_ids[len(ids):] == hf_greedy(hf, ids, 3)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(hf, all_ids)
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, ref[range(len(all_ids) - 1), all_ids[1:]], atol=1e-4), (got, ref)
    for p, top in enumerate(lp.top_logprobs[1:len(ids)]):            # the prompt's top 2 at each position
        best = ref[p].topk(2)
        assert [int(t.split(':')[1]) for t in top] == best.indices.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), best.values, atol=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3

def test_echo_max_tokens_zero_returns_the_prompt(server, client, tok, hf):
    ids = tok(PROMPT).input_ids
    r = client.completions.create(model='tiny', prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == tok.decode(ids) and c.finish_reason == 'length'
    assert len(c.logprobs.token_logprobs) == len(ids)
    ref = hf_logprobs(hf, ids)
    assert torch.allclose(torch.tensor(c.logprobs.token_logprobs[1:]), ref[range(len(ids) - 1), ids[1:]], atol=1e-4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    text_only = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=0, echo=True)
    assert text_only.choices[0].text == PROMPT and text_only.choices[0].logprobs is None
    assert refused(server, 'completions', {'model': 'tiny', 'prompt': PROMPT, 'max_tokens': 0}) == (400, 'max_tokens')

def test_echo_streams_the_prompt_first(client):
    plain = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=5, temperature=0, extra_body={'ignore_eos': True})
    chunks = list(client.completions.create(model='tiny', prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True,
                                            extra_body={'ignore_eos': True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert ''.join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPT + plain.choices[0].text
    only = list(client.completions.create(model='tiny', prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert ''.join(ch.choices[0].text for ch in only) == PROMPT and only[-1].choices[0].finish_reason == 'length'

def test_prompt_logprobs_extra(client, tok, hf):
    ids = tok(PROMPT).input_ids
    ref = hf_logprobs(hf, ids)
    r = client.completions.create(model='tiny', prompt=PROMPT, max_tokens=2, temperature=0, extra_body={'prompt_logprobs': 1})
    plp = r.choices[0].model_extra['prompt_logprobs']
    assert len(plp) == len(ids) and plp[0] is None
    for p, (token, entry) in enumerate(zip(ids[1:], plp[1:])):
        assert abs(entry[str(token)]['logprob'] - ref[p, token].item()) < 1e-4
        assert str(int(ref[p].argmax())) in entry                     # the top 1, beside the prompt's token
    assert r.choices[0].logprobs is None                              # the completion's were not asked for
    chat = client.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=2,
                                          extra_body={'prompt_logprobs': 0})
    chat_plp = chat.model_extra['prompt_logprobs']
    assert chat_plp[0] is None and all(len(e) == 1 for e in chat_plp[1:])

# -- the request shapes of lm-eval's local-completions ---------------------------------------------------------------------
def test_lm_eval_loglikelihood_and_generate_until_shapes(server, tok, hf):
    "lm-eval `local-completions` posts these bodies (lm_eval/models/openai_completions.py) and reads them like this."
    pairs = [('The capital of France is', ' Paris'), ('Colours: red, green,', ' blue'), ('def main():', " print('hello')")]
    contexts = [tok(c).input_ids for c, _ in pairs]                   # tokenized_requests: token ids, a batch per request
    continuations = [tok(x, add_special_tokens=False).input_ids for _, x in pairs]
    for max_tokens in (1, 0):
        body = {'model': 'tiny', 'prompt': [c + x for c, x in zip(contexts, continuations)], 'temperature': 0,
                'max_tokens': max_tokens, 'logprobs': 1, 'seed': 1234, 'echo': True}
        out = post(server, 'completions', body).json()
        for choice, ctx, cont in zip(sorted(out['choices'], key=lambda c: c['index']), contexts, continuations):
            ids = ctx + cont
            lps = choice['logprobs']['token_logprobs']
            assert len(lps) == len(ids) + max_tokens
            got = lps[len(ctx):len(ids)]                              # lm-eval: token_logprobs[ctxlen:-1] with max_tokens 1
            ref = hf_logprobs(hf, ids)[range(len(ctx) - 1, len(ids) - 1), cont]
            assert torch.allclose(torch.tensor(got), ref, atol=1e-4)
            greedy = all(lp == max(top.values()) for lp, top in zip(got, choice['logprobs']['top_logprobs'][len(ctx):len(ids)]))
            assert greedy == (hf_logprobs(hf, ids)[range(len(ctx) - 1, len(ids) - 1)].argmax(-1).tolist() == cont)
    string_body = {'model': 'tiny', 'prompt': [c + x for c, x in pairs], 'temperature': 0, 'max_tokens': 1, 'logprobs': 1,
                   'seed': 1234, 'echo': True}
    for choice, (c, x) in zip(post(server, 'completions', string_body).json()['choices'], pairs):
        assert choice['text'].startswith(c + x)
    generate = {'model': 'tiny', 'prompt': contexts, 'max_tokens': 6, 'temperature': 0, 'stop': ['\n\n'], 'seed': 1234}
    out = post(server, 'completions', generate).json()
    for choice, ctx in zip(sorted(out['choices'], key=lambda c: c['index']), contexts):
        want = tok.decode(hf_greedy(hf, ctx, 6), skip_special_tokens=True).split('\n\n')[0]
        assert choice['text'] == want

# -- logit_bias, allowed_token_ids, bad_words ------------------------------------------------------------------------------
def _token_ids(choice) -> list[int]: return [int(t.split(':')[1]) for t in choice.logprobs.tokens]

def test_logit_bias_allowed_tokens_and_bad_words(server, client, tok):
    ids = dict(model='tiny', prompt=PROMPT, max_tokens=6, logprobs=0, extra_body={'return_tokens_as_token_ids': True})
    for temperature in (0, 1.0):                                      # greedy and sampled alike
        biased = client.completions.create(**ids, temperature=temperature, logit_bias={'7': 100})
        assert _token_ids(biased.choices[0]) == [7] * 6
        allowed = client.completions.create(**{**ids, 'extra_body': {**ids['extra_body'], 'allowed_token_ids': [9, 11]}},
                                            temperature=temperature)
        assert set(_token_ids(allowed.choices[0])) <= {9, 11}
    chat = client.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=4,
                                          temperature=0, logit_bias={'7': 100}, logprobs=True,
                                          extra_body={'return_tokens_as_token_ids': True})
    assert [c.token for c in chat.choices[0].logprobs.content] == ['token_id:7'] * 4
    first = _token_ids(client.completions.create(**ids, temperature=0).choices[0])[0]
    word = tok.decode([first])
    assert tok(word, add_special_tokens=False).input_ids == [first]   # the word is that one token
    banned = client.completions.create(**{**ids, 'extra_body': {**ids['extra_body'], 'bad_words': [word]}}, temperature=0)
    assert first not in _token_ids(banned.choices[0])

BAD = [('completions', {'logit_bias': {'x': 1}}, 'logit_bias'), ('completions', {'logit_bias': {'5': 101}}, 'logit_bias'),
       ('completions', {'logit_bias': {'5': 'high'}}, 'logit_bias'), ('completions', {'logit_bias': {'99999': 1}}, 'logit_bias'),
       ('chat/completions', {'logit_bias': {'-3': 1}}, 'logit_bias'), ('completions', {'allowed_token_ids': []}, 'allowed_token_ids'),
       ('completions', {'allowed_token_ids': [99999]}, 'allowed_token_ids'), ('completions', {'bad_words': ['']}, 'bad_words'),
       ('completions', {'prompt_logprobs': 21}, 'prompt_logprobs'), ('completions', {'echo': True, 'logprobs': 21}, 'logprobs'),
       ('completions', {'foo': 1}, 'foo'), ('chat/completions', {'best_of': 2}, 'best_of'),
       ('chat/completions', {'continue_final_message': True}, 'continue_final_message'),
       ('completions', {'stream_options': {'continuous_usage_stats': 'often'}}, 'stream_options')]

@pytest.mark.parametrize('endpoint,change,param', BAD, ids=[f'{e}-{p}' for e, _, p in BAD])
def test_bad_values_name_the_field(server, endpoint, change, param):
    base = {'model': 'tiny', 'prompt': PROMPT, 'max_tokens': 4} if endpoint == 'completions' else chat_base()
    assert refused(server, endpoint, {**base, **change}) == (400, param)

def test_meaningless_fields_are_ignored(server):
    for endpoint, base in (('completions', {'model': 'tiny', 'prompt': PROMPT, 'max_tokens': 2}), ('chat/completions', chat_base())):
        r = post(server, endpoint, {**base, 'user': 'u-1', 'store': False, 'metadata': {'run': 'x'}})
        assert r.status_code == 200, r.text

# -- models, usage, the chat template ---------------------------------------------------------------------------------------
def test_models_retrieve(server, client):
    card = client.models.retrieve('tiny')
    assert (card.id, card.object, card.model_extra['max_model_len']) == ('tiny', 'model', 512)
    with pytest.raises(openai.NotFoundError): client.models.retrieve('gpt-4')
    r = httpx.get(f'{server.url}/v1/models/gpt-4')
    assert (r.status_code, r.json()['error']['param'], r.json()['error']['code']) == (404, 'model', 'model_not_found')

def test_continuous_usage_stats(client, tok):
    chunks = list(client.completions.create(model='tiny', prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={'include_usage': True, 'continuous_usage_stats': True},
                                            extra_body={'ignore_eos': True}))
    counted = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None and ch.usage.prompt_tokens == len(tok(PROMPT).input_ids) for ch in chunks)
    assert counted == sorted(counted) and counted[-1] == 6 and chunks[-1].choices == []
    plain = list(client.completions.create(model='tiny', prompt=PROMPT, max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in plain)

def test_chat_template_switches(client, tok):
    "`add_generation_prompt: false` and `continue_final_message` render the template as `transformers` does, and echo."
    msgs = [{'role': 'user', 'content': 'The capital of France?'}, {'role': 'assistant', 'content': 'It is'}]
    kw = dict(model='tiny', max_tokens=5, temperature=0, extra_body={'ignore_eos': True})
    def completion_of(text):
        return client.completions.create(prompt=tok(text, add_special_tokens=False).input_ids, **kw).choices[0].text
    cont = client.chat.completions.create(messages=msgs, **{**kw, 'extra_body': {**kw['extra_body'], 'continue_final_message': True,
                                                                                 'add_generation_prompt': False}})
    rendered = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert rendered.endswith('It is') and cont.choices[0].message.content == completion_of(rendered)
    no_turn = client.chat.completions.create(messages=msgs[:1], **{**kw, 'extra_body': {**kw['extra_body'], 'add_generation_prompt': False}})
    assert no_turn.choices[0].message.content == completion_of(tok.apply_chat_template(msgs[:1], tokenize=False))
    with_turn = client.chat.completions.create(messages=msgs[:1], **kw)
    assert with_turn.choices[0].message.content == completion_of(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))
    echoed = client.chat.completions.create(messages=msgs, **{**kw, 'extra_body': {**kw['extra_body'], 'continue_final_message': True,
                                                                                   'add_generation_prompt': False, 'echo': True}})
    assert echoed.choices[0].message.content == 'It is' + cont.choices[0].message.content
    streamed = client.chat.completions.create(messages=msgs, stream=True, **{**kw, 'extra_body': {
        **kw['extra_body'], 'continue_final_message': True, 'add_generation_prompt': False, 'echo': True}})
    assert ''.join(ch.choices[0].delta.content or '' for ch in streamed if ch.choices) == echoed.choices[0].message.content
