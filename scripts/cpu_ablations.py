#!/usr/bin/env python3
"""In-process A/B of the CPU decode optimisations of chapter 15's table.

One engine (SmolLM2-135M-Instruct, fp32, plain loop) holds a steady decode batch of requests with contexts of
32-512 tokens; the variants below are switched on and off by patching the engine in place, and alternated step
by step so that the machine's noise hits them alike. 'all on' runs a step's layers in one C call (chapter 06a's
`decode_layers_cpu`); every other variant runs them through the modules, the second with nothing else changed. Prints the median step time of each, and its ratio to
everything on:

    python scripts/cpu_ablations.py [BATCH]      # default 32

and, for prefill, one step of 64 prompts of 128 tokens (8192 tokens) with the linears through the C product,
oneDNN (packed weights) or MKL, alternated:

    python scripts/cpu_ablations.py prefill [ROUNDS]   # default 3
"""
import random, statistics, sys, time
import torch
import nanoserve.model as M
from nanoserve.config import EngineConfig
from nanoserve.checkpoints import smollm2_path
from nanoserve.llm import make_engine
from nanoserve.req import SamplingParams

VARIANTS = ['all on', 'layers through the modules (no one-call step)', 'gather + SDPA attention (no C kernel)', 'torch small ops (no C ops)', 'oneDNN linear (packed weights)',
            'MKL linear (F.linear)']
C_LINEAR = M.linear

def linear_switch(model):
    "A function that routes the model's linears to 'C', 'oneDNN' or 'MKL'."
    panels = {id(p): p.cpu_panels for p in model.parameters() if hasattr(p, 'cpu_panels')}
    onednn = {i: torch.ops.mkldnn._reorder_linear_weight(p.detach(), 64) for p in model.parameters() if (i := id(p)) in panels}
    def onednn_linear(x, weight, bias=None):
        w = onednn.get(id(weight))
        if w is None or x.dim() != 2: return C_LINEAR(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, 'none', [], '')
    def use(kind):
        M.linear = onednn_linear if kind == 'oneDNN' else C_LINEAR
        for p in model.parameters():
            if id(p) not in panels: continue
            if kind == 'MKL': p.__dict__.pop('cpu_panels', None)
            else: p.cpu_panels = panels[id(p)]
    return use

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
    linears, decoder = linear_switch(model), model.model.cpu_decoder
    def use(name):
        model.model.cpu_decoder = decoder if name == 'all on' else None    # the others run the layers through the modules
        linears('MKL' if name.startswith('MKL') else 'oneDNN' if name.startswith('oneDNN') else 'C')
        backend.use_cpu_kernel = name != 'gather + SDPA attention (no C kernel)'
        model.use_ops(M.TORCH_OPS if name == 'torch small ops (no C ops)' else M.CPU_OPS)
    times = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            use(name); start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
    use('all on')
    base = statistics.median(times['all on'])
    print(f'decode batch {batch}, contexts 32-512; median ms per step over {rounds} steps each, variants interleaved')
    for name in VARIANTS:
        t = statistics.median(times[name])
        print(f'{name:48s} {1e3 * t:7.1f} ms  x{t / base:.2f}')

def prefill(rounds: int = 3):
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False, enable_prefix_caching=False))
    rng, sp = random.Random(0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    linears = linear_switch(engine.worker.model)
    times = {'C product': [], 'oneDNN (packed weights)': [], 'MKL': []}
    for r in range(rounds):
        for name in times:
            linears(name.split()[0])
            for i in range(64): engine.add_request(f'{r}-{name}-{i}', [rng.randrange(100, 10000) for _ in range(128)], sp)
            start = time.perf_counter(); engine.step(); times[name].append(time.perf_counter() - start)
            while engine.has_unfinished: engine.step()
    linears('C')
    base = statistics.median(times['C product'])
    print(f'prefill of 64 x 128 tokens in one step; median s per step over {rounds} steps each, variants interleaved')
    for name, ts in times.items(): print(f'{name:40s} {statistics.median(ts):7.2f} s  x{statistics.median(ts) / base:.2f}')

if __name__ == '__main__':
    if sys.argv[1:2] == ['prefill']: prefill(*map(int, sys.argv[2:]))
    else: main(*map(int, sys.argv[1:]))
