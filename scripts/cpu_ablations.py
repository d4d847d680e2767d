#!/usr/bin/env python3
"""In-process A/B of each CPU decode optimisation of chapter 15's table.

One engine (SmolLM2-135M-Instruct, fp32, plain loop) holds a steady decode batch of requests with contexts of
32-512 tokens; the variants below are switched on and off by patching the engine in place, and alternated step
by step so that the machine's noise hits them alike. Prints the median step time of each, and its ratio to
everything on:

    python scripts/cpu_ablations.py [BATCH]      # default 32

and, for prefill, one step of 64 prompts of 128 tokens (8192 tokens) with the long linears through oneDNN in
1024-row slices or through MKL, alternated:

    python scripts/cpu_ablations.py prefill [ROUNDS]   # default 3
"""
import random, statistics, sys, time
import nanoserve.model as M
from nanoserve.config import EngineConfig
from nanoserve.cli import smollm2_path
from nanoserve.llm import make_engine
from nanoserve.req import SamplingParams

VARIANTS = ['all on', 'gather + SDPA attention (no C kernel)', 'torch small ops (no C ops)', 'MKL linear (F.linear)',
            'oneDNN linear, unpacked', 'oneDNN rows padded to 16']

def main(batch: int = 32, rounds: int = 6):
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False))
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(100, 10000) for _ in range(rng.randint(32, 512))]
        engine.add_request(i, prompt, SamplingParams(temperature=0, max_tokens=len(VARIANTS) * rounds + 4, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or sched.prefilling: engine.step()
    engine.step()
    model, backend = engine.worker.model, engine.worker.backend
    packed = {id(p): p.onednn_packed for p in model.parameters() if hasattr(p, 'onednn_packed')}
    rows = M.onednn_rows
    def use(name):
        M._ONEDNN_LINEAR = name != 'MKL linear (F.linear)'
        for p in model.parameters():
            if id(p) not in packed: continue
            if name in ('MKL linear (F.linear)', 'oneDNN linear, unpacked'): p.__dict__.pop('onednn_packed', None)
            else: p.onednn_packed = packed[id(p)]
        backend.use_cpu_kernel = name != 'gather + SDPA attention (no C kernel)'
        model.use_ops(M.TORCH_OPS if name == 'torch small ops (no C ops)' else M.CPU_OPS)
        M.onednn_rows = (lambda m: -(-m // 16) * 16) if name == 'oneDNN rows padded to 16' else rows
    times = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            use(name); start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
    use('all on')
    base = statistics.median(times['all on'])
    print(f'decode batch {batch}, contexts 32-512; median ms per step over {rounds} steps each, variants interleaved')
    for name in VARIANTS:
        t = statistics.median(times[name])
        print(f'{name:40s} {1e3 * t:7.1f} ms  x{t / base:.2f}')

def prefill(rounds: int = 3):
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False, enable_prefix_caching=False))
    rng, sp, slice_rows = random.Random(0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), M.ONEDNN_SLICE_ROWS
    times = {'oneDNN 1024-row slices': [], 'MKL': []}
    for r in range(rounds):
        for name in times:
            M.ONEDNN_SLICE_ROWS = 1 << 62 if name == 'MKL' else slice_rows
            for i in range(64): engine.add_request(f'{r}-{name}-{i}', [rng.randrange(100, 10000) for _ in range(128)], sp)
            start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
            while engine.has_unfinished: engine.step()
    M.ONEDNN_SLICE_ROWS = slice_rows
    base = statistics.median(times['oneDNN 1024-row slices'])
    print(f'prefill of 64 x 128 tokens in one step; median s per step over {rounds} steps each, variants interleaved')
    for name, ts in times.items(): print(f'{name:40s} {statistics.median(ts):7.2f} s  x{statistics.median(ts) / base:.2f}')

if __name__ == '__main__':
    if sys.argv[1:2] == ['prefill']: prefill(*map(int, sys.argv[2:]))
    else: main(*map(int, sys.argv[1:]))
