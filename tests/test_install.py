"""Installing nanoserve keeps the user's torch: the package pins neither torch nor triton, and a dry-run resolve against
the environment (which has a torch: the CPU build here, a CUDA one the same way) installs nanoserve and nothing else."""
import json, subprocess, sys
from configparser import ConfigParser
from pathlib import Path

ROOT = Path(__file__).parent.parent

def test_requirements_leave_torch_and_triton_to_the_user():
    cfg = ConfigParser(delimiters=['='])
    cfg.read(ROOT / 'settings.ini')
    reqs = cfg['DEFAULT']['requirements'].split()
    assert not [r for r in reqs if r.startswith('triton')], reqs        # a CUDA torch brings its own; a CPU needs none
    assert all('==' not in r for r in reqs if r.startswith('torch')), reqs
    assert 'triton==' in cfg['DEFAULT']['dev_requirements']               # the interpreter tests' version, for development

def test_dry_run_resolve_installs_only_nanoserve(tmp_path):
    report = tmp_path / 'report.json'
    r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--dry-run', '--no-index', '--no-build-isolation', '--quiet',
                        '--report', str(report), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    installed = [item['metadata']['name'].lower() for item in json.loads(report.read_text())['install']]
    assert installed == ['nanoserve'], installed
