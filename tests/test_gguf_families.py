"""A GGUF file of every family llama.cpp names (chapter 07c), written as llama.cpp's converter writes it
(`save_tiny_gguf`: its architecture, metadata keys, tensor names, Llama's q/k row order, Phi-3's fused tensors,
Gemma's norms with their +1 stored, experts as 3-D tensors or one 2-D tensor each), served by the engine: greedy
tokens equal transformers' on the same weights (the original checkpoint for F32; for F16 and Q8_0, the checkpoint
with each weight the file quantizes replaced by its round trip through that format), for prompts past the sliding
window where the family has one. What llama.cpp's files cannot say is refused, naming it."""
import json, shutil
import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from nanoserve.config import ModelConfig
from nanoserve.engine import Engine
from nanoserve.quant_load import gguf_model_dir
from nanoserve.req import SamplingParams
from nanoserve.testing import LLAMA_CPP_SHAPES, TINY_FAMILIES, hf_greedy, save_tiny_gguf, save_tiny_model

PROMPTS = [list(range(3, 40)), [5, 6, 7]]   # 37 tokens: past the 16-position window
N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
GGUF_SHAPES = {family: (LLAMA_CPP_SHAPES[family], quant_type) for family, quant_type in (   # and the weights' format
    ('llama', 'F16'), ('mistral', 'F32'), ('qwen2', 'Q8_0'), ('qwen3', 'F16'), ('phi3', 'Q8_0'), ('olmo2', 'F32'),
    ('gemma2', 'F16'), ('gemma3_text', 'Q8_0'), ('mixtral', 'F32'), ('qwen3_moe', 'Q8_0'))}

def hf_greedy_prompts(path) -> list[list[int]]: return hf_greedy(path, PROMPTS, N)

def rounded_copy(hf_dir, out, quant_type: str):
    "The checkpoint with each weight `save_tiny_gguf` stores in `quant_type` replaced by its round trip through it."
    shutil.copytree(hf_dir, out)
    qtype = gguf.GGMLQuantizationType[quant_type]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    weights = load_file(hf_dir / 'model.safetensors')
    for name, w in weights.items():
        router = name.endswith(('.mlp.gate.weight', '.block_sparse_moe.gate.weight'))   # kept F32 in the file
        if w.ndim < 2 or router or w.shape[-1] % block_size: continue
        values = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
        weights[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(w.shape)
    save_file(weights, out / 'model.safetensors', metadata={'format': 'pt'})
    return out

def shrink_embedding(hf_dir, factor: float = 0.1):
    "A tied random model repeats the prompt's last token (its embedding dominates what the head reads); less so here."
    weights = load_file(hf_dir / 'model.safetensors')
    weights['model.embed_tokens.weight'] *= factor
    save_file(weights, hf_dir / 'model.safetensors', metadata={'format': 'pt'})

def engine_greedy(gguf_file) -> list[list[int]]:
    with Engine(model=str(gguf_file), device='cpu', page_size=4, num_pages=256) as engine:
        return [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]

def test_every_family_has_a_gguf_shape():
    assert sorted(GGUF_SHAPES) == sorted(TINY_FAMILIES)

@pytest.mark.parametrize('family', sorted(GGUF_SHAPES))
def test_gguf_greedy_equals_transformers(family, tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    overrides, quant_type = GGUF_SHAPES[family]
    hf_dir = save_tiny_model(tmp_path / family, family, seed=1, tokenizer=True, **overrides)
    if overrides.get('tie_word_embeddings'): shrink_embedding(hf_dir)
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / f'{family}.gguf', quant_type)
    reference = hf_greedy_prompts(hf_dir if quant_type == 'F32' else rounded_copy(hf_dir, tmp_path / 'rounded', quant_type))
    assert len({t for r in reference for t in r}) > 5, 'the reference should not be a constant'
    assert engine_greedy(gguf_file) == reference

def test_experts_one_tensor_each(tmp_path, monkeypatch):
    "llama.cpp's older Mixtral files: `blk.N.ffn_gate.E.weight`, one 2-D tensor per expert, not one 3-D tensor."
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    hf_dir = save_tiny_model(tmp_path / 'mixtral', 'mixtral', seed=1, tokenizer=True, sliding_window=None)
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / 'mixtral.gguf', merge_experts=False)
    names = {t.name for t in gguf.GGUFReader(gguf_file).tensors}
    assert 'blk.0.ffn_gate.3.weight' in names and 'blk.0.ffn_gate_exps.weight' not in names
    assert engine_greedy(gguf_file) == hf_greedy_prompts(hf_dir)

def test_what_llama_cpp_cannot_say_is_refused(tmp_path):
    mistral = save_tiny_model(tmp_path / 'mistral', 'mistral', tokenizer=True)   # a window of 16
    with pytest.raises(ValueError, match="llama.cpp's llama GGUF cannot say a sliding window"):
        save_tiny_gguf(mistral, tmp_path / 'mistral.gguf')
    gemma = save_tiny_model(tmp_path / 'gemma2', 'gemma2', tokenizer=True, tie_word_embeddings=True)
    with pytest.raises(ValueError, match='query_pre_attn_scalar 24'):
        save_tiny_gguf(gemma, tmp_path / 'gemma2.gguf')

def test_an_architecture_nanoserve_does_not_serve_is_named(tmp_path):
    hf_dir = save_tiny_model(tmp_path / 'llama', 'llama', tokenizer=True)
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / 'llama.gguf')
    reader = gguf.GGUFReader(gguf_file)
    renamed = tmp_path / 'falcon.gguf'
    data = bytearray(gguf_file.read_bytes())
    field = reader.fields['general.architecture']
    start = int(field.parts[-1].ctypes.data - reader.data.ctypes.data)    # the arch string's bytes in the file
    data[start:start + 5] = b'bloom'                                      # same length: the layout stays valid
    renamed.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="architecture 'bloom' is not one nanoserve serves"):
        gguf_model_dir(renamed, tmp_path / 'cache')

def test_llama3_rope_factors_are_read_as_llama3_scaling(tmp_path, monkeypatch):
    "Llama 3.1 and 3.2 files store their rope scaling as per-frequency factors (`rope_freqs.weight`), not parameters."
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    scaling = {'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': 8192}
    hf_dir = save_tiny_model(tmp_path / 'llama3', 'llama', seed=1, tokenizer=True, rope_theta=500000.0,
                             rope_scaling=scaling)
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / 'llama3.gguf')
    assert 'rope_freqs.weight' in {t.name for t in gguf.GGUFReader(gguf_file).tensors}
    served = json.loads((gguf_model_dir(gguf_file) / 'config.json').read_text())
    original = json.loads((hf_dir / 'config.json').read_text())
    assert ModelConfig.from_dict(served).rope_scaling == ModelConfig.from_dict(original).rope_scaling
    assert engine_greedy(gguf_file) == hf_greedy_prompts(hf_dir)

@pytest.mark.parametrize('family, quant_type, merge', [('qwen3_moe', 'Q4_0', True), ('mixtral', 'Q8_0', True),
                                                       ('mixtral', 'Q4_1', False)])
def test_quantized_experts_stay_blocks(family, quant_type, merge, tmp_path, monkeypatch):
    "A mixture's quantized experts load on a CPU as blocks, one `QuantizedWeight` an expert, not as fp32 stacks."
    from nanoserve.quant import QuantizedExperts
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    shape = {'qwen3_moe': dict(moe_intermediate_size=64), 'mixtral': dict(sliding_window=None, intermediate_size=96)}
    hf_dir = save_tiny_model(tmp_path / family, family, seed=1, tokenizer=True, **shape[family])
    gguf_file = save_tiny_gguf(hf_dir, tmp_path / f'{family}.gguf', quant_type, merge_experts=merge)
    with Engine(model=str(gguf_file), device='cpu', page_size=4, num_pages=256) as engine:
        experts = [layer.mlp.experts for layer in engine.worker.model.model.layers]
        stacks = [getattr(e, name) for e in experts for name in ('gate_up_proj', 'down_proj')]
        assert all(isinstance(s, QuantizedExperts) and s.experts[0].quant_type == quant_type for s in stacks)
        assert not [name for name, _ in engine.worker.model.named_parameters() if '.experts.' in name]
        tokens = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert tokens == hf_greedy_prompts(rounded_copy(hf_dir, tmp_path / 'rounded', quant_type))
