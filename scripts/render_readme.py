#!/usr/bin/env python3
"""Render `nbs/index.ipynb` to `README.md` without quarto (which these machines cannot install).

Markdown cells are copied as they are; code cells become ```python blocks, minus `#|` directive
lines; their text outputs follow as plain blocks; cells marked `#| hide` are left out.
A markdown line that is exactly `<!-- bench-targets -->` becomes the table of chapter 15a's targets,
read from the stored runs in `nbs/bench_results/` (`nanoserve.results.target_rows`).
`--check` renders to memory and exits 1 when README.md differs, so CI catches a stale README.
"""
import argparse, difflib, sys
from pathlib import Path
from execnb.nbio import read_nb

root = Path(__file__).resolve().parent.parent
BENCH_TARGETS = '<!-- bench-targets -->'

def _targets_table() -> str:
    "The targets of chapter 15a as a Markdown table, each figure read from the stored runs."
    sys.path.insert(0, str(root))     # this checkout's nanoserve, not another installed one
    from nanoserve.results import MOE_CHECKS, SPEC_CHECKS, TARGET_HEADER, load_runs, quant_target_rows, target_rows
    runs = load_runs(root/'nbs'/'bench_results')
    rows = target_rows(runs) + (quant_target_rows(runs) if runs.get('quant') else [])
    rows += target_rows(runs, SPEC_CHECKS) if runs.get('spec') else []
    rows += target_rows(runs, MOE_CHECKS) if runs.get('moe') else []
    lines = [TARGET_HEADER, ['---'] * len(TARGET_HEADER), *rows]
    return '\n'.join('| ' + ' | '.join(line) + ' |' for line in lines)

def _markdown(src: str) -> str:
    "A markdown cell's text, with the targets table in place of its marker line."
    lines = src.strip('\n').split('\n')
    return '\n'.join(_targets_table() if line.strip() == BENCH_TARGETS else line for line in lines)

def _directives(src: str) -> set[str]:
    return {l[3:].strip().split()[0] for l in src.splitlines() if l.startswith('#|') and l[3:].strip()}

def _outputs(cell) -> list[str]:
    texts = []
    for o in cell.get('outputs', []):
        if o.get('output_type') == 'stream': texts.append(''.join(o.get('text', '')))
        elif 'data' in o and 'text/markdown' in o['data']: texts.append(''.join(o['data']['text/markdown']))
        elif 'data' in o and 'text/plain' in o['data']: texts.append(''.join(o['data']['text/plain']))
    return [t.rstrip('\n') for t in texts if t.strip()]

def render(nb_path: Path) -> str:
    parts = ['<!-- Generated from nbs/index.ipynb by scripts/render_readme.py: edit the notebook, not this file. -->']
    for cell in read_nb(nb_path).cells:
        src = cell.source
        if cell.cell_type == 'markdown':
            parts.append(_markdown(src))
            continue
        if cell.cell_type != 'code' or 'hide' in _directives(src): continue
        code = '\n'.join(l for l in src.splitlines() if not l.startswith('#|')).strip('\n')
        if code: parts.append(f'```python\n{code}\n```')
        parts += [f'```\n{t}\n```' for t in _outputs(cell)]
    return '\n\n'.join(parts) + '\n'

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--check', action='store_true', help='fail if README.md is not what the notebook renders to')
    args = ap.parse_args()
    text, readme = render(root/'nbs'/'index.ipynb'), root/'README.md'
    if not args.check:
        readme.write_text(text, encoding='utf-8')
        return
    old = readme.read_text(encoding='utf-8') if readme.exists() else ''
    if old != text:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), 'README.md', 'rendered'))
        sys.exit('README.md is out of date with nbs/index.ipynb: run `python scripts/render_readme.py`')

if __name__ == '__main__': main()
