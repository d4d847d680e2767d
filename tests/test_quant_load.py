"""Quantized checkpoints (chapter 07c) across ranks: a GGUF's blocks and weights quantized at load give TP 1's greedy
tokens at TP 2, each rank holding whole blocks of its shard; a split that would cut a block is refused."""
import pytest
from nanoserve.engine import Engine
from nanoserve.tp import TPEngine
from nanoserve.quant import QuantizedWeight
from nanoserve.quant_load import gguf_model_dir, load_checkpoint
from nanoserve.req import SamplingParams
from nanoserve.testing import save_tiny_gguf, save_tiny_model

PROMPTS = [[5, 17, 33, 62, 91, 14, 7, 88], [42], list(range(30, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

def greedy_tokens(engine_class, **kwargs) -> list[list[int]]:
    with engine_class(device='cpu', page_size=4, num_pages=64, **kwargs) as engine:
        return [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]

@pytest.mark.parametrize('arch,quant_type', [('llama', 'Q4_1'), ('qwen3', 'Q8_0')])
def test_gguf_tp2_matches_tp1(tmp_path, monkeypatch, arch, quant_type):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))   # the GGUF's directory, written by rank 0's process
    hf_dir = save_tiny_model(tmp_path / arch, arch, seed=1, tokenizer=True)
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / f'{arch}.gguf', quant_type)
    tp1 = greedy_tokens(Engine, model=str(gguf_file))
    assert greedy_tokens(TPEngine, model=str(gguf_file), tensor_parallel_size=2) == tp1

def test_quantized_at_load_tp2_matches_tp1(tmp_path):
    path = save_tiny_model(tmp_path / 'qwen2', 'qwen2', seed=2)
    tp1 = greedy_tokens(Engine, model=str(path), quantization='int4')
    assert greedy_tokens(TPEngine, model=str(path), quantization='int4', tensor_parallel_size=2) == tp1

def test_ranks_hold_whole_blocks(tmp_path):
    "A rank's shard of a row-parallel weight is whole blocks; a width that would cut one is refused, naming it."
    hf_dir = save_tiny_model(tmp_path / 'llama', 'llama', tokenizer=True)
    model_dir = gguf_model_dir(save_tiny_gguf(hf_dir, tmp_path / 'llama.gguf', 'Q8_0'), tmp_path / 'cache')
    net, _ = load_checkpoint(model_dir, tp_rank=1, tp_size=2)
    down = net.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, QuantizedWeight) and down.shape == (64, 64)
    wide = save_tiny_model(tmp_path / 'wide', 'llama', tokenizer=True, hidden_size=96, num_attention_heads=2,
                           num_key_value_heads=2)   # o_proj: 96 columns, 48 a rank: not whole blocks of 32
    wide_dir = gguf_model_dir(save_tiny_gguf(wide, tmp_path / 'wide.gguf', 'Q8_0'), tmp_path / 'cache')
    with pytest.raises(ValueError, match='o_proj.*not whole Q8_0 blocks of 32'):
        load_checkpoint(wide_dir, tp_rank=0, tp_size=2)
