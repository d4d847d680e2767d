"""Every model family of chapter 00's `FAMILIES` through the engine, against `transformers` on the same tiny random
weights: greedy tokens equal at page sizes 1 and 16, with a cold and a warm prefix cache, on the default CPU backend
and the torch reference, for prompts that run past the sliding window (16 positions) where the family has one; and
with tensor parallelism over 2 ranks for a windowed family, a mixture of experts and OLMo 2's all-heads q/k norm."""
import pytest
from nanoserve.engine import Engine
from nanoserve.req import SamplingParams
from nanoserve.testing import TINY_FAMILIES, hf_greedy, save_tiny_model

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(100, 120)) * 2]   # 37, 3 and 40 tokens
N = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)

def hf_greedy_prompts(path) -> list[list[int]]: return hf_greedy(path, PROMPTS, N)

@pytest.fixture(scope='module', params=sorted(TINY_FAMILIES))
def family(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param) / 'model', request.param, seed=3)
    return request.param, path, hf_greedy_prompts(path)

@pytest.mark.parametrize('backend', ['auto', 'torch'])
@pytest.mark.parametrize('page_size', [1, 16])
def test_greedy_equals_transformers(family, backend, page_size):
    name, path, ref = family
    e = Engine(model=str(path), device='cpu', attention_backend=backend, page_size=page_size,
               num_pages=4096 // page_size)
    assert len({t for r in ref for t in r}) > 10, 'the reference should not be a constant'
    assert [r.output_ids for r in e.generate(PROMPTS, GREEDY)] == ref, f'{name}: cold cache'
    assert [r.output_ids for r in e.generate(PROMPTS, GREEDY)] == ref, f'{name}: warm prefix cache'
    e.scheduler.check_integrity()

@pytest.mark.parametrize('name', ['mistral', 'qwen3_moe', 'olmo2'])
def test_tensor_parallel_equals_transformers(name, tmp_path):
    from nanoserve.tp import TPEngine
    path = save_tiny_model(tmp_path / name, name, seed=3)
    with TPEngine(model=str(path), device='cpu', page_size=4, num_pages=1024, tensor_parallel_size=2) as tp:
        assert [r.output_ids for r in tp.generate(PROMPTS, GREEDY)] == hf_greedy_prompts(path)

def test_readme_lists_every_family():
    from pathlib import Path
    from nanoserve.config import FAMILIES
    readme = (Path(__file__).parent.parent / 'README.md').read_text()
    assert all(f'`{arch}`' in readme for arch in FAMILIES)

def test_windowed_kv_memory_stays_flat(tmp_path):
    "A Mistral-style request (every layer windowed, 16 positions) growing far past its window: its pages stay flat."
    path = save_tiny_model(tmp_path / 'mistral', 'mistral', seed=3)
    e = Engine(model=str(path), device='cpu', page_size=4, num_pages=256)
    assert e.scheduler.kv_window == 16
    req = e.add_request(0, list(range(3, 20)), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    used = []
    while e.has_unfinished:
        e.step()
        if not req.finished: used.append(e.scheduler.allocator.num_pages - e.scheduler.allocator.num_free)
    e.scheduler.check_integrity()
    assert len(req.output_ids) == 150
    # the prompt's 4 whole pages, held by the prefix cache, and the window's 4 pages and the one being filled
    assert max(used[30:]) <= 17 // 4 + 16 // 4 + 1
    assert max(used) < (17 + 150) // 4            # far below what the whole sequence would hold
    [hf] = hf_greedy(path, [list(range(3, 20))], 150)
    assert req.output_ids == hf

