#!/usr/bin/env python3
"""Execute notebooks in place so their committed outputs show what the code really does.

The outputs are documentation (`nbdev_clean` keeps them); tests never read them. Cells that
`nbdev_test` would skip (the `tst_flags` of settings.ini) are skipped here too, so a CPU machine
refreshes everything except the `#| cuda` and `#| slow` cells. Usage:
`python scripts/run_notebooks.py [nbs/03_pages.ipynb ...]` (default: every notebook). Each notebook runs
in a process of its own, as `nbdev_test` runs them: a chapter that chooses the Triton interpreter must do so
before anything imports `triton`.
"""
import os, subprocess, sys
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from nbdev.config import get_config
from nbdev.process import NBProcessor, extract_directives

def _skip(flags):
    def skip(cell):
        if cell.cell_type != 'code': return True
        if 'nbdev_export(' in cell.source: return True
        d = extract_directives(cell, remove=False)
        if d.get('eval:', [''])[0].lower() == 'false': return True
        return bool(flags & d.keys())
    return skip

def main(paths):
    cfg = get_config()
    flags = set(cfg.tst_flags.split())
    os.environ['IN_TEST'] = '1'
    paths = [Path(p).resolve() for p in paths] or sorted(cfg.config_path.joinpath(cfg.nbs_path).glob('[0-9a-z]*.ipynb'))
    if len(paths) > 1:
        for p in paths: subprocess.run([sys.executable, __file__, str(p)], check=True)
        return
    for p in paths:
        nb = read_nb(p)
        cwd = os.getcwd(); os.chdir(p.parent)
        for cell in nb.cells:   # a cell that prints nothing now must not keep what an earlier run printed
            if not _skip(flags)(cell): cell.outputs = []
        try: CaptureShell(p).run_all(nb, exc_stop=True, preproc=_skip(flags))
        finally: os.chdir(cwd)
        write_nb(nb, p)
        print('executed', p.name)

if __name__ == '__main__': main(sys.argv[1:])
