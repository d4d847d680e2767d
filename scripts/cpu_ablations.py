#!/usr/bin/env python3
"""In-process A/B of each CPU decode optimisation of chapter 15's table.

One engine (SmolLM2-135M-Instruct, fp32, plain loop) holds a steady decode batch of requests with contexts of
32-512 tokens; the variants below are switched on and off by patching the engine in place, and alternated step
by step so that the machine's noise hits them alike. Prints the median step time of each, and its ratio to
everything on:

    python scripts/cpu_ablations.py [BATCH]      # default 32
"""
import random, statistics, sys, time
import nanoserve.model as M, nanoserve.metadata as MD
from nanoserve.config import EngineConfig
from nanoserve.cli import smollm2_path
from nanoserve.llm import make_engine
from nanoserve.req import SamplingParams

VARIANTS = ['all on', 'MKL linear (F.linear)', 'oneDNN linear, unpacked', 'no tiles', 'fresh gather buffers', 'no length groups']

def main(batch: int = 32, rounds: int = 6):
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False))
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(100, 10000) for _ in range(rng.randint(32, 512))]
        engine.add_request(i, prompt, SamplingParams(max_tokens=len(VARIANTS) * rounds + 4, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or sched.prefilling: engine.step()
    engine.step()
    model, backend = engine.worker.model, engine.worker.backend
    packed = {id(p): p.onednn_packed for p in model.parameters() if hasattr(p, 'onednn_packed')}
    gather, groups = MD.TorchAttentionBackend._gather, MD.length_groups
    def use(name):
        M._ONEDNN_LINEAR = name != 'MKL linear (F.linear)'
        for p in model.parameters():
            if id(p) not in packed: continue
            if name in ('MKL linear (F.linear)', 'oneDNN linear, unpacked'): p.__dict__.pop('onednn_packed', None)
            else: p.onednn_packed = packed[id(p)]
        backend.tile_bytes = 1 << 40 if name == 'no tiles' else MD.TorchAttentionBackend.tile_bytes
        MD.TorchAttentionBackend._gather = (lambda self, pool, pages, n: pool.index_select(0, pages)) if name == 'fresh gather buffers' else gather
        MD.length_groups = (lambda lens, ps, **kw: [(None, -(-max(lens) // ps))]) if name == 'no length groups' else groups
    times = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            use(name); start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
    use('all on')
    base = statistics.median(times['all on'])
    print(f'decode batch {batch}, contexts 32-512; median ms per step over {rounds} steps each, variants interleaved')
    for name in VARIANTS:
        t = statistics.median(times[name])
        print(f'{name:26s} {1e3 * t:7.1f} ms  x{t / base:.2f}')

if __name__ == '__main__': main(*map(int, sys.argv[1:]))
