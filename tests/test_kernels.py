"""The Triton kernels compile for the GPUs nanoserve targets, at every production configuration, on this CPU
(`nanoserve check-kernels`, chapter 06): no compile error, no register spill, shared memory within the limit."""
import os, subprocess, sys
import pytest

@pytest.mark.parametrize('arch', ['sm_90', 'sm_80'])
def test_check_kernels(arch):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}   # compiled kernels, not interpreted
    r = subprocess.run([sys.executable, '-m', 'nanoserve.cli', 'check-kernels', '--arch', arch], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f'{arch}: ' in r.stdout and ' ok' in r.stdout
