"""The README's examples run as written. Every Python block of README.md runs in a fresh interpreter, and the `curl`
request of the server example (after the loop that waits for `/health`) is sent as it is. SmolLM2 stands in as a
tiny random model of the same family (the blocks call it `smollm2`, which resolves to the tiny model here), and the
server the examples talk to is one of that model on a free port: the blocks are otherwise unchanged. What each block
prints is checked against the engine itself."""
import json, re, shlex, subprocess, sys
from pathlib import Path
import httpx
import pytest
from nanoserve.llm import LLM
from nanoserve.req import SamplingParams
from nanoserve.testing import ServerProcess, save_tiny_model

README = Path(__file__).resolve().parent.parent / 'README.md'
README_URL = 'http://127.0.0.1:8000'
ENGINE = dict(device='cpu', page_size=4, num_pages=256)

def blocks(language: str) -> list[str]:
    "The fenced code blocks of README.md in `language`, in order."
    return re.findall(rf'^```{language}\n(.*?)^```$', README.read_text(), flags=re.M | re.S)

def run_block(code: str, model_dir: str) -> subprocess.CompletedProcess:
    "Run a README block in a fresh interpreter, where the name `smollm2` resolves to `model_dir`."
    stand_in = (f'import pathlib, nanoserve.checkpoints as checkpoints\n'
                f'checkpoints.smollm2_path = lambda *args, **kwargs: pathlib.Path({model_dir!r})\n'
                f'checkpoints.NAMED_MODELS["smollm2"] = checkpoints.smollm2_path\n')
    return subprocess.run([sys.executable, '-c', stand_in + code], capture_output=True, text=True, timeout=600)

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'smollm2-stand-in', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    with ServerProcess(model_dir, served_model_name='smollm2', **ENGINE) as s: yield s

KINDS = {'openai': lambda b: 'OpenAI(' in b, 'offline': lambda b: 'LLM(' in b,
         'naive loop': lambda b: 'AutoModelForCausalLM' in b, 'sampling params': lambda b: b.startswith('SamplingParams(')}

def test_every_python_block_is_checked():
    kinds = [[kind for kind, match in KINDS.items() if match(b)] for b in blocks('python')]
    assert sorted(k for ks in kinds for k in ks) == sorted(KINDS) and all(len(ks) == 1 for ks in kinds), kinds

def test_offline_llm_block(model_dir):
    block = next(b for b in blocks('python') if 'LLM(' in b)
    result = run_block(block, model_dir)
    assert result.returncode == 0, result.stderr
    with LLM(model_dir, **ENGINE) as llm:
        expected = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert result.stdout == expected[0].outputs[0].text + '\n'

def test_naive_loop_block_stands_alone(model_dir):
    result = run_block(next(b for b in blocks('python') if 'AutoModelForCausalLM' in b), model_dir)
    assert result.returncode == 0, result.stderr
    assert 'The capital of France is' in result.stdout

def test_sampling_params_block(model_dir):
    result = run_block('from nanoserve import SamplingParams\n' + next(b for b in blocks('python') if b.startswith('SamplingParams(')),
                       model_dir)
    assert result.returncode == 0, result.stderr

def test_openai_block_prints_the_stream(server, model_dir):
    block = next(b for b in blocks('python') if 'OpenAI(' in b)
    assert README_URL in block and 'max_tokens=24, temperature=0, stream=True' in block
    result = run_block(block.replace(README_URL, server.url), model_dir)
    assert result.returncode == 0, result.stderr
    answer = httpx.post(server.url + '/v1/chat/completions', timeout=60, json={     # the same request, not streamed
        'model': 'smollm2', 'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
        'max_tokens': 24, 'temperature': 0}).json()
    assert result.stdout == answer['choices'][0]['message']['content'] + '\n'

def test_curl_block_is_a_valid_request(server):
    block = next(b for b in blocks('sh') if 'curl http' in b)
    assert 'until curl -sf -o /dev/null http://127.0.0.1:8000/health' in block    # it waits for the server first
    words = shlex.split(block[block.index('curl http'):])
    assert words[1] == README_URL + '/v1/chat/completions'
    response = httpx.post(server.url + '/v1/chat/completions', json=json.loads(words[words.index('-d') + 1]), timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()['choices'][0]['message']['content']
