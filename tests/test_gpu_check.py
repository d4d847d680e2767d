"""scripts/gpu_check.sh, rehearsed on this CPU (REHEARSE=1): the steps it runs on a GPU machine keep working."""
import os, subprocess
from pathlib import Path

def test_gpu_check_rehearsal(tmp_path):
    root = Path(__file__).parent.parent
    r = subprocess.run(['bash', str(root / 'scripts' / 'gpu_check.sh')], cwd=root, capture_output=True, text=True, timeout=900,
                       env={**os.environ, 'REHEARSE': '1', 'OUT': str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'notebooks                    passed' in r.stdout, r.stdout[-2000:]
