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
