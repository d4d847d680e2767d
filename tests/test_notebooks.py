"""Every notebook is a test module: run each one as `nbdev_test` would, one pytest case per chapter."""
from pathlib import Path
import pytest
import nbdev.test as nbt
from nbdev.config import get_config

cfg = get_config()
notebooks = sorted(p for p in cfg.config_path.joinpath(cfg.nbs_path).glob('*.ipynb') if not p.name.startswith(('_', '.')))
OPTIONAL = {'17_replicas': 'ray.serve'}      # chapters of an optional extra (nanoserve[ray]): skipped without it

@pytest.mark.parametrize('nb', notebooks, ids=[p.stem for p in notebooks])
def test_notebook(nb: Path):
    if nb.stem in OPTIONAL: pytest.importorskip(OPTIONAL[nb.stem])
    passed, seconds = nbt.test_nb(nb, skip_flags=cfg.tst_flags.split(), basepath=cfg.config_path)
    assert passed, f'{nb.name} failed (traceback above)'
