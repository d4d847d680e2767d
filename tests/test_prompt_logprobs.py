"""Prompt logprobs on long prompts: the scoring holds a bounded block of logits whatever the prompt's length, still
equals transformers, and a long prompt with `prompt_logprobs: 20` on a server completes while a stream beside it
keeps flowing."""
import asyncio, time
import httpx
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from nanoserve.engine import Engine
from nanoserve.req import SamplingParams
from nanoserve.testing import ServerProcess, save_tiny_model

VOCAB = 300     # no other tensor of the tiny model has a last dimension of this size

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'long', 'llama', vocab_size=VOCAB,
                               max_position_embeddings=2048))

class VocabRows(TorchDispatchMode):
    "The most rows of any tensor an op makes whose last dimension is the vocabulary: the largest block of logits."
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == VOCAB:
                self.most = max(self.most, t.shape[0])
        return out

def _prompt(n: int) -> list[int]: return [(i * 37 + 11) % (VOCAB - 3) + 3 for i in range(n)]

def test_largest_logits_block_does_not_grow_with_the_prompt(model_dir):
    "One prefill step scores the whole prompt; the logits it holds at once are as many rows for 600 or 1,500 tokens."
    engine = Engine(model=model_dir, device='cpu', page_size=16, num_pages=256, max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    most = {}
    for n in (600, 1500):
        with VocabRows() as rows:
            req = engine.generate([_prompt(n)], params)[0]
        assert len(req.prompt_logprobs) == n
        most[n] = rows.most
    assert most[1500] == most[600] < 600, most

def test_long_prompt_logprobs_equal_transformers(model_dir):
    "Across many blocks and prefill chunks, every prompt token's logprob and top 5 equal transformers' within 1e-4."
    from transformers import AutoModelForCausalLM
    prompt = _prompt(1200)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad(): ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for budget in (4096, 300):
        engine = Engine(model=model_dir, device='cpu', page_size=16, num_pages=256, max_num_batched_tokens=budget)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
        got = engine.generate([prompt], params)[0].prompt_logprobs
        assert got[0] is None and [e.token for e in got[1:]] == prompt[1:]
        logprobs = torch.tensor([e.logprob for e in got[1:]])
        torch.testing.assert_close(logprobs, ref[range(len(prompt) - 1), prompt[1:]], atol=1e-4, rtol=0)
        top = torch.tensor([[lp for _, lp in e.top] for e in got[1:]])
        torch.testing.assert_close(top, ref[:-1].topk(5, -1).values, atol=1e-4, rtol=0)

def test_scored_prompt_tokens_reach_the_tokenizer_process_step_by_step(tmp_path):
    """Each step reports only the prompt tokens it scored, in messages as small as its chunk (the tokenizer process
    turns them into entries meanwhile), and the first output still carries every prompt token's entry."""
    from transformers import AutoTokenizer
    from nanoserve.server.messages import GenerateReq, StepOut, encode
    from nanoserve.server.scheduler import SchedulerWorker
    from nanoserve.server.tokenizer import TokenizerWorker
    path = save_tiny_model(tmp_path / 'tok', 'llama', tokenizer=True, max_position_embeddings=2048)
    tokenizer_worker = TokenizerWorker(AutoTokenizer.from_pretrained(path))
    chunk = 128
    engine = Engine(model=str(path), device='cpu', page_size=16, num_pages=128, max_num_batched_tokens=chunk)
    scheduler_worker = SchedulerWorker(engine)
    prompt = [(i * 37 + 11) % 400 + 3 for i in range(1000)]
    params = {'temperature': 0, 'max_tokens': 1, 'prompt_logprobs': 5}
    assert scheduler_worker.handle(tokenizer_worker.tokenize(GenerateReq('r', params, prompt_ids=prompt))) is None
    reported, message_bytes, texts = [], [], []
    while engine.has_unfinished:
        step = StepOut(scheduler_worker.step())
        reported += [len(t.prompt_logprobs) for t in step.outputs if t.prompt_logprobs]
        message_bytes.append(len(encode(step)))
        texts += tokenizer_worker.detokenize(step)[0].outputs
    assert sum(reported) == len(prompt) - 1 and max(reported) <= chunk, reported     # each entry once, as scored
    assert max(message_bytes) < 2 * min(message_bytes[:-1]), message_bytes     # no step carries the whole prompt
    entries = texts[0].prompt_logprobs
    assert [e[0] for e in entries] == prompt and entries[0][2] is None
    assert all(len(e[3]) == 5 and e[1] == tokenizer_worker.token_str(e[0]) for e in entries[1:])

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp('models') / 'served', 'llama', tokenizer=True,
                           max_position_embeddings=2048)
    s = ServerProcess(str(path), served_model_name='tiny', device='cpu', page_size=4, num_pages=600).start()
    yield s
    s.stop()

def test_long_prompt_with_20_prompt_logprobs_beside_a_stream(server):
    "1,500 prompt tokens scored with their top 20 complete, and a stream beside them gets a token in most steps."
    async def run():
        async with httpx.AsyncClient(timeout=600) as c:
            stream_times, first = [], asyncio.Event()
            async def stream():
                body = {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 1900, 'ignore_eos': True, 'stream': True}
                async with c.stream('POST', server.url + '/v1/completions', json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith('data:') and line != 'data: [DONE]':
                            stream_times.append(time.monotonic())
                            first.set()
            task = asyncio.create_task(stream())
            await first.wait()
            start = time.monotonic()
            body = {'model': 'tiny', 'prompt': _prompt(1500), 'max_tokens': 1, 'prompt_logprobs': 20}
            r = await c.post(server.url + '/v1/completions', json=body)
            end = time.monotonic()
            await task
            return r, stream_times, start, end
    r, stream_times, start, end = asyncio.run(run())
    assert r.status_code == 200, r.text[:200]
    plp = r.json()['choices'][0]['prompt_logprobs']
    assert len(plp) == 1500 and plp[0] is None
    assert all(len(entry) >= 20 for entry in plp[1:])      # the top 20, and the prompt token when it is not among them
    beside = sum(start <= t <= end for t in stream_times)
    steps = 1500 // 32                                     # the server's steps carry 32 tokens on a CPU (chapter 15a)
    assert beside >= steps // 2, (beside, steps)      # the stream was not held back while the prompt was scored

def test_answer_with_prompt_logprobs_is_not_walked_again_by_fastapis_encoder(monkeypatch):
    """The API server builds its answer as plain JSON; FastAPI's `jsonable_encoder` (pure Python, a second for 7,000
    prompt tokens with their top 20, on the event loop every stream shares) never walks it again."""
    import fastapi.routing
    from fastapi.testclient import TestClient
    from nanoserve.server.frontend import Frontend
    from nanoserve.server.app import build_app
    from nanoserve.server.messages import TextOut
    frontend = Frontend('tiny', {}, info={'path': '/models/tiny', 'max_model_len': 512})
    entries = [[5, 'a', None, []]] + [[5, 'a', -1.0, [[6, 'b', -0.5], [5, 'a', -1.0]]] for _ in range(300)]
    def answer(msg, data=None):      # the tokenizer and scheduler processes, stood in for: one choice, one token
        out = TextOut(msg.rid, 0, 'b', [6], None, 'length', None, 301, 0, prompt_logprobs=entries)
        frontend.routes[msg.rid].feed(out)
    monkeypatch.setattr(frontend, 'send', answer)
    walked = []
    encoder = fastapi.routing.jsonable_encoder
    def counting(obj, *args, **kwargs):
        if isinstance(obj, dict) and 'choices' in obj: walked.append(obj)
        return encoder(obj, *args, **kwargs)
    monkeypatch.setattr(fastapi.routing, 'jsonable_encoder', counting)
    body = {'model': 'tiny', 'prompt': [5] * 301, 'max_tokens': 1, 'prompt_logprobs': 2}
    r = TestClient(build_app(frontend)).post('/v1/completions', json=body)
    assert r.status_code == 200, r.text[:200]
    plp = r.json()['choices'][0]['prompt_logprobs']
    assert len(plp) == 301 and plp[0] is None and plp[1] == {'5': {'logprob': -1.0, 'decoded_token': 'a'},
                                                              '6': {'logprob': -0.5, 'decoded_token': 'b'}}
    assert walked == []
