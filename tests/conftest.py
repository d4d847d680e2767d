"""pytest's harness: before any test imports triton, choose Triton's interpreter when there is no GPU (chapter 95)."""
from nanoserve.testing import use_triton_interpreter

use_triton_interpreter()

import os
import pytest

def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: runs a real model (SmolLM2); skipped unless NANOSERVE_SLOW=1')

def pytest_collection_modifyitems(config, items):
    if os.environ.get('NANOSERVE_SLOW'): return
    for item in items:
        if 'slow' in item.keywords: item.add_marker(pytest.mark.skip(reason='slow: set NANOSERVE_SLOW=1 to run'))
