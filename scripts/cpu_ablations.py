#!/usr/bin/env python3
"""In-process A/B of the CPU decode optimisations of chapter 15's table.

One engine (SmolLM2-135M-Instruct, fp32, plain loop, the C backend of appendix B) holds a steady decode batch of
requests with contexts of 32-512 tokens; the variants below are switched on and off by patching the engine in place,
and alternated step by step so that the machine's noise hits them alike. 'all on' runs a step's layers in one C call
(the backend's layers runner, `decode_layers_cpu`); every other variant runs them through the modules, the second with
nothing else changed. Prints the median step time of each, and its ratio to everything on:

    python scripts/cpu_ablations.py [BATCH] [--json PATH]     # default 32; PATH: store the run (chapter 15a reads it)

and, for prefill, one step of 64 prompts of 128 tokens (8192 tokens) with the linears through the C product,
oneDNN (packed weights) or MKL, alternated:

    python scripts/cpu_ablations.py prefill [ROUNDS]   # default 3
"""
import json, os, random, statistics, sys, time
import torch
import torch.nn.functional as F
from nanoserve.bench import environment
from nanoserve.config import EngineConfig
from nanoserve.checkpoints import smollm2_path
from nanoserve.llm import make_engine
from nanoserve.metadata import TorchAttentionBackend
from nanoserve.model import TORCH_OPS
from nanoserve.req import SamplingParams

os.environ['NANOSERVE_CPU_LINEAR'] = 'c'   # the C product, whatever the backend would measure: 'all on' is the one-call step

VARIANTS = ['all on', 'layers through the modules (no one-call step)', 'gather + SDPA attention (no C kernel)', 'torch small ops (no C ops)', 'oneDNN linear (packed weights)',
            'MKL linear (F.linear)']

def linears(model, backend):
    "The products the variants route the model's linears to: 'C' (the backend's packed weights), 'oneDNN' or 'MKL'."
    packed = backend.packed
    onednn = {id(p): torch.ops.mkldnn._reorder_linear_weight(p.detach(), 64) for p in model.parameters() if packed.panels(p) is not None}
    def onednn_linear(x, weight, bias=None):
        w = onednn.get(id(weight))
        if w is None or x.dim() != 2: return packed.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, 'none', [], '')
    return {'C': packed.linear, 'oneDNN': onednn_linear, 'MKL': F.linear}

def use(engine, cpu, reference, products, name):
    "Switch the engine to variant `name`."
    model = engine.worker.model
    engine.worker.backend = reference if name.startswith('gather') else cpu
    model.use_layers_runner(cpu.decode_layers if name == 'all on' else None)   # the others run the layers through the modules
    small = TORCH_OPS if name.startswith('torch small ops') else cpu.ops
    kind = 'MKL' if name.startswith('MKL') else 'oneDNN' if name.startswith('oneDNN') else 'C'
    model.use_ops(small._replace(linear=products[kind]))

def main(batch: int = 32, rounds: int = 6, json_path: str | None = None):
    env = environment()   # at the start: the load of the machine's other work, not of this run
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False))
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(100, 10000) for _ in range(rng.randint(32, 512))]
        engine.add_request(i, prompt, SamplingParams(temperature=0, max_tokens=len(VARIANTS) * rounds + 4, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or sched.prefilling: engine.step()
    engine.step()
    cpu = engine.worker.backend
    assert cpu.name == 'cpu', f'the C backend did not load (attention backend: {cpu.name})'
    reference = TorchAttentionBackend(engine.worker.k_cache, engine.worker.v_cache, cpu.scale)
    products = linears(engine.worker.model, cpu)
    times = {n: [] for n in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            use(engine, cpu, reference, products, name)
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    use(engine, cpu, reference, products, 'all on')
    base = statistics.median(times['all on'])
    print(f'decode batch {batch}, contexts 32-512; median ms per step over {rounds} steps each, variants interleaved')
    rows = []
    for name in VARIANTS:
        t = statistics.median(times[name])
        rows.append(dict(variant=name, median_ms=1e3 * t, ratio=t / base, step_ms=[1e3 * x for x in times[name]]))
        print(f'{name:48s} {1e3 * t:7.1f} ms  x{t / base:.2f}')
    if json_path:
        result = dict(kind='cpu-ablations', batch_size=batch, rounds=rounds, variants=rows, environment=env,
                      command=f'python scripts/cpu_ablations.py {batch}')
        with open(json_path, 'w') as f: json.dump(result, f, indent=1)

def prefill(rounds: int = 3):
    engine = make_engine(EngineConfig(model=str(smollm2_path()), enable_overlap=False, enable_prefix_caching=False))
    rng, sp = random.Random(0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    model, cpu = engine.worker.model, engine.worker.backend
    assert cpu.name == 'cpu', f'the C backend did not load (attention backend: {cpu.name})'
    products = linears(model, cpu)
    times = {'C product': [], 'oneDNN (packed weights)': [], 'MKL': []}
    for r in range(rounds):
        for name in times:
            model.use_ops(cpu.ops._replace(linear=products[name.split()[0]]))
            for i in range(64): engine.add_request(f'{r}-{name}-{i}', [rng.randrange(100, 10000) for _ in range(128)], sp)
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
            while engine.has_unfinished: engine.step()
    model.use_ops(cpu.ops)
    base = statistics.median(times['C product'])
    print(f'prefill of 64 x 128 tokens in one step; median s per step over {rounds} steps each, variants interleaved')
    for name, ts in times.items(): print(f'{name:40s} {statistics.median(ts):7.2f} s  x{statistics.median(ts) / base:.2f}')

if __name__ == '__main__':
    if sys.argv[1:2] == ['prefill']: prefill(*map(int, sys.argv[2:]))
    else:
        args = sys.argv[1:]
        json_path = args.pop(args.index('--json') + 1) if '--json' in args else None
        if '--json' in args: args.remove('--json')
        main(*map(int, args), json_path=json_path)
