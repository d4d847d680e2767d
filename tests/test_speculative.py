"""Speculative decoding behind the server: `nanoserve serve --speculative-config` answers the official `openai` client
with the greedy tokens a server without speculation gives, and `/metrics` counts the drafts."""
import json, re, urllib.request
import pytest
from openai import OpenAI
from nanoserve.testing import ServerProcess, save_tiny_model

ENGINE = dict(device='cpu', page_size=4, num_pages=256)
NGRAM = json.dumps({'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_min': 1, 'prompt_lookup_max': 3})
PROMPTS = ['the cat sat on the mat and the cat sat on the', 'one two three one two three one two', 'Hello']

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('spec') / 'tiny', 'llama', seed=5, tokenizer=True))

def answers(server) -> tuple[list, list]:
    "Greedy completions (their token ids) and chat replies of PROMPTS, through the openai client."
    client = OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=120)
    completions, chats = [], []
    for prompt in PROMPTS:
        out = client.completions.create(model='tiny', prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                        extra_body={'ignore_eos': True, 'return_tokens_as_token_ids': True})
        completions.append(out.choices[0].logprobs.tokens)
        chat = client.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': prompt}],
                                              max_tokens=16, temperature=0)
        chats.append(chat.choices[0].message.content)
    return completions, chats

def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url + '/metrics') as response: text = response.read().decode()
    return float(re.search(rf'^nanoserve:{name}(?:_total)?{{[^}}]*}} (\S+)$', text, re.M).group(1))

def test_server_answers_equal_with_and_without_speculation(model_dir):
    with ServerProcess(model_dir, cli=True, served_model_name='tiny', **ENGINE) as server: plain = answers(server)
    with ServerProcess(model_dir, cli=True, served_model_name='tiny', speculative_config=NGRAM, **ENGINE) as server:
        assert answers(server) == plain
        drafted = metric(server, 'spec_decode_num_draft_tokens')
        accepted = metric(server, 'spec_decode_num_accepted_tokens')
        assert drafted > 0 and 0 <= accepted <= drafted
        assert metric(server, 'spec_decode_draft_acceptance_rate') == pytest.approx(accepted / drafted)

def test_bad_speculative_config_is_refused_at_start(model_dir):
    from nanoserve.config import EngineConfig
    with pytest.raises(ValueError, match='method'):
        EngineConfig(model=model_dir, speculative_config='{"method": "eagle", "num_speculative_tokens": 2}')

CODE = 'def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n'

def test_stop_string_inside_a_verified_run_ends_the_tokens_there():
    "A stop string completed by a token inside an accepted run: the tokens, logprobs and usage end at that token."
    from nanoserve import LLM, SamplingParams
    params = SamplingParams(temperature=0, stop=['mul'], max_tokens=64, logprobs=1)
    outputs = []
    for kw in ({}, {'speculative_config': {'method': 'ngram', 'num_speculative_tokens': 4}}):
        with LLM('smollm2', **kw) as llm:
            out = llm.generate([CODE], params, use_tqdm=False)[0].outputs[0]
            outputs.append((out.text, out.token_ids, len(out.logprobs), out.finish_reason, out.stop_reason))
            if kw: assert llm.engine.scheduler.stats()['spec_accepted_tokens'] > 0
    assert outputs[1] == outputs[0]
    assert outputs[0][3:] == ('stop', 'mul')

def test_server_stop_string_usage_and_logprobs_end_at_the_stop():
    "The same through the server, streaming and not: the logprob tokens and usage end at the token completing 'mul'."
    def run(server):
        client = OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=120)
        res = []
        for stream in (False, True):
            out = client.completions.create(model='smol', prompt=CODE, max_tokens=64, temperature=0, logprobs=0,
                                            stop=['mul'], stream=stream, stream_options={'include_usage': True}
                                            if stream else None)
            chunks = list(out) if stream else [out]
            tokens = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens]
            text = ''.join(choice.text for c in chunks for choice in c.choices)
            usage = next(c.usage for c in reversed(chunks) if c.usage is not None)
            res.append((text, tokens, usage.completion_tokens))
        return res
    engine = dict(device='cpu', served_model_name='smol')
    with ServerProcess('smollm2', cli=True, **engine) as server: plain = run(server)
    spec = json.dumps({'method': 'ngram', 'num_speculative_tokens': 4})
    with ServerProcess('smollm2', cli=True, speculative_config=spec, **engine) as server:
        assert run(server) == plain
        assert metric(server, 'spec_decode_num_accepted_tokens') > 0
    assert plain[0][2] == len(plain[0][1]) and plain[0][0].endswith('def ')   # the text stops before 'mul'

def test_n_seeded_and_structured_requests_beside_speculating_ones():
    "n = 2 seeded samples, a JSON-schema request (not speculated) and greedy ones in one batch: the plain outputs."
    pytest.importorskip('xgrammar')
    from nanoserve import LLM, SamplingParams
    from nanoserve.req import StructuredOutputsParams
    schema = {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 0, 'maximum': 99}},
              'required': ['n']}
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=32, logprobs=1),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))]
    results = []
    for kw in ({}, {'speculative_config': {'method': 'ngram', 'num_speculative_tokens': 4}}):
        with LLM('smollm2', **kw) as llm:
            outputs = llm.generate([CODE] * 3, params, use_tqdm=False)
            results.append([[(o.text, o.token_ids, [sorted(d) for d in o.logprobs or []]) for o in r.outputs]
                            for r in outputs])
            if kw: assert llm.engine.scheduler.stats()['spec_accepted_tokens'] > 0
    assert results[1] == results[0]
    assert [len(r) for r in results[0]] == [1, 2, 1]
    assert set(json.loads(results[0][2][0][0])) == {'n'}
