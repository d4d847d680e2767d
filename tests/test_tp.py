"""Tensor parallelism under `torchrun`, as a user would launch it over several machines: each rank is a fresh process
that joins through torchrun's variables (a notebook cell cannot be a torchrun worker). TP 2 gives TP 1's tokens."""
import json, os, subprocess, sys
from nanoserve.engine import Engine
from nanoserve.testing import save_tiny_model
from nanoserve.req import SamplingParams

SCRIPT = '''
import json, os, sys, torch
from nanoserve.config import EngineConfig
from nanoserve.req import SamplingParams
from nanoserve.tp import TPEngine, run_follower
config = EngineConfig(model=sys.argv[1], device='cpu', page_size=4, num_pages=64, tensor_parallel_size=int(os.environ['WORLD_SIZE']))
if os.environ['RANK'] == '0':
    with TPEngine(config, timeout_s=120) as engine:
        reqs = engine.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert engine.ranks == []      # torchrun started the other rank; the engine started none
    with open(sys.argv[3], 'w') as f: json.dump([r.output_ids for r in reqs], f)
else:
    run_follower(config, timeout_s=120)
'''

def test_torchrun_tp2_matches_tp1(tmp_path):
    path = save_tiny_model(tmp_path / 'model', 'qwen2', seed=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    prompts = [[5, 17, 33, 62, 91, 14, 7, 88], [42], list(range(30, 50))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [r.output_ids for r in Engine(model=str(path), device='cpu', page_size=4, num_pages=64).generate(prompts, greedy)]
    (tmp_path / 'main.py').write_text(SCRIPT)
    out = tmp_path / 'out.json'
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                           str(tmp_path / 'main.py'), str(path), json.dumps(prompts), str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text()) == ref
