#!/usr/bin/env python3
"""GPU benchmark: Qwen3-0.6B-shaped random weights through nanoserve on one GPU.

1. the nano-vllm workload: 256 requests, random prompt ids, prompt and output lengths uniform in [100, 1024],
   ignore_eos, reported as output tokens/s;
2. batch-1 decode latency (ms per output token, CUDA graphs on);
3. decode attention at batch 64 and 4k context (Qwen3-0.6B heads), as achieved bandwidth over the K/V bytes read,
   as a fraction of the H200's 4.3 TB/s.

Random weights come without a tokenizer, so the engine is driven with token ids. Prints a table; with
`--json PATH` also writes the figures. Needs a CUDA GPU.
"""
import argparse, json, random, tempfile, time
from pathlib import Path
import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)

def qwen3_06b_dir(root: Path) -> Path:
    "Random Qwen3-0.6B-shaped weights saved as a bf16 Hugging Face directory (built on the GPU: seconds)."
    from transformers import Qwen3Config, Qwen3ForCausalLM
    path = root / 'qwen3-0.6b-random'
    cfg = Qwen3Config(**QWEN3_06B); cfg.architectures = ['Qwen3ForCausalLM']
    torch.manual_seed(0)
    with torch.device('cuda'): model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model; torch.cuda.empty_cache()
    return path

def timed(fn) -> float:
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return time.perf_counter() - t

def throughput(engine, n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> dict:
    "The nano-vllm workload: output tokens per second."
    from nanoserve import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(lo, hi), ignore_eos=True) for _ in range(n)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))                     # warm up
    reqs = []
    dt = timed(lambda: reqs.extend(engine.generate(prompts, params)))
    tokens = sum(len(r.output_ids) for r in reqs)
    return dict(requests=n, output_tokens=tokens, seconds=dt, tokens_per_s=tokens / dt)

def batch1_latency(engine, prompt_len: int = 128, new: int = 512) -> dict:
    "Milliseconds per decoded token for a single request (its prefill time subtracted)."
    from nanoserve import SamplingParams
    prompt = list(range(1000, 1000 + prompt_len))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))          # warm up
    prefill = timed(lambda: engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0)))
    total = timed(lambda: engine.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)))
    return dict(ms_per_token=1000 * (total - prefill) / (new - 1), prefill_ms=1000 * prefill)

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--json', help='also write the figures to this file')
    ap.add_argument('--requests', type=int, default=256)
    args = ap.parse_args()
    assert torch.cuda.is_available(), 'this benchmark needs a CUDA GPU'
    from nanoserve.config import EngineConfig
    from nanoserve.llm import make_engine
    from nanoserve.kernels import bench_decode_attention
    res = {'device': torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine(EngineConfig(model=str(qwen3_06b_dir(Path(d))), dtype='bfloat16'))
        res['throughput'] = throughput(engine, n=args.requests)
        res['batch1'] = batch1_latency(engine)
    res['decode_attention'] = bench_decode_attention(batch=64, context=4096)
    att = res['decode_attention']
    rows = [(f"nano-vllm workload ({args.requests} req, 100-1024 in/out)", f"{res['throughput']['tokens_per_s']:,.0f} tok/s", 'target >= 20,000'),
            ('batch-1 decode', f"{res['batch1']['ms_per_token']:.2f} ms/token", 'target <= 1.5'),
            ('decode attention, bs 64, 4k ctx', f"{att['gb_per_s']:,.0f} GB/s = {100 * att['fraction_of_peak']:.0f}% of 4.3 TB/s", 'target >= 70%')]
    w = max(len(r[0]) for r in rows)
    print(f"\n{res['device']}")
    for name, value, target in rows: print(f'{name:<{w}}  {value:>34}  ({target})')
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1, default=str))

if __name__ == '__main__': main()
