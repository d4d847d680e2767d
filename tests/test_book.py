"""The book's own rules, checked on every notebook and on the package: cross references name chapters that exist,
no stored output holds a progress bar, no exported cell is too long to read, the package is pyflakes-clean, and
`nanoserve --help` and `--version` answer without importing torch."""
import json, re, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / 'nbs'
NOTEBOOKS = sorted(NBS.glob('*.ipynb'))
MAX_EXPORTED_LINES = 150

def cells(nb_path: Path) -> list[dict]:
    return json.loads(nb_path.read_text(encoding='utf-8'))['cells']

def source(cell: dict) -> str:
    return ''.join(cell['source'])

def chapter_ids() -> set[str]:
    "The chapter numbers the book has: '00', '05z', '14a', ... (the notebooks' name prefixes)."
    return {p.name.split('_')[0] for p in NOTEBOOKS if '_' in p.name}

def appendix_letters() -> set[str]:
    "The appendices the book has, from the titles '# Appendix A: ...'."
    titles = (source(cells(p)[i]) for p in NOTEBOOKS for i in range(min(3, len(cells(p)))))
    return {m.group(1) for t in titles for m in re.finditer(r'^# Appendix ([A-Z])\b', t, flags=re.M)}

CHAPTER_REF = re.compile(r'\b[Cc]hapters? ((?:\d\d?[a-z]?)(?:(?:,? and |, | or |/|-|–| to )\d\d?[a-z]?)*)\b')
APPENDIX_REF = re.compile(r'\b[Aa]ppendi(?:x|ces) ((?:[A-Z]|\d\d)(?:(?:,? and |, | or )(?:[A-Z]|\d\d))*)\b')

def references(text: str) -> list[str]:
    "The chapters and appendices a text cites: 'chapter 06a', 'chapters 5 and 11', 'appendix B' as 06a, 05, 11, B."
    refs = [n.zfill(2) if n[-1].isdigit() else n.zfill(3) for m in CHAPTER_REF.finditer(text)
            for n in re.findall(r'\d\d?[a-z]?', m.group(1))]
    return refs + [x for m in APPENDIX_REF.finditer(text) for x in re.findall(r'[A-Z]|\d\d', m.group(1))]

def test_references_parse():
    text = 'chapter 06a; chapters 5 and 11; Chapter 14z, appendix B; appendices A and B; chapters 14a-14f; a chapter'
    assert references(text) == ['06a', '05', '11', '14z', '14a', '14f', 'B', 'A', 'B']

def test_every_reference_names_a_chapter():
    known = chapter_ids() | appendix_letters()
    assert {'00', '05z', '14f', '90', 'A', 'B'} <= known, known
    missing = [f'{p.name} cell {i}: {ref}' for p in NOTEBOOKS for i, c in enumerate(cells(p))
               for ref in references(source(c)) if ref not in known]
    assert not missing, 'references to chapters that do not exist:\n' + '\n'.join(missing)

PROGRESS_BAR = re.compile(r'\d+%\|.*\|| \d+/\d+ \[\d+:\d\d<|(?:it/s|s/it)\]')

def output_text(output: dict) -> str:
    data = output.get('data', {})
    parts = [output.get('text', '')] + [data[k] for k in ('text/plain', 'text/markdown', 'text/html') if k in data]
    return ''.join(''.join(p) if isinstance(p, list) else p for p in parts)

def test_progress_bar_pattern():
    assert PROGRESS_BAR.search('\rWriting model shards: 100%|##########| 1/1 [00:00<00:00, 608.66it/s]\n')
    assert PROGRESS_BAR.search('Loading weights:  40%|████      | 2/5 [00:01<00:02,  1.50s/it]')
    assert not PROGRESS_BAR.search('decode at batch 32: 61% of the ceiling | 172 tok/s')

def test_no_stored_progress_bar():
    bars = [f'{p.name} cell {i}: {output_text(o)[:80]!r}' for p in NOTEBOOKS for i, c in enumerate(cells(p))
            for o in c.get('outputs', []) if PROGRESS_BAR.search(output_text(o))]
    assert not bars, 'stored progress bars:\n' + '\n'.join(bars)

def exported(cell: dict) -> bool:
    return cell['cell_type'] == 'code' and bool(re.search(r'^#\|\s*export', source(cell), flags=re.M))

def long_exported_cells() -> list[str]:
    return [f'{p.name} cell {i}: {len(source(c).splitlines())} lines' for p in NOTEBOOKS for i, c in enumerate(cells(p))
            if exported(c) and len(source(c).splitlines()) > MAX_EXPORTED_LINES]

def test_no_exported_cell_over_150_lines():
    long = long_exported_cells()
    assert not long, f'exported cells over {MAX_EXPORTED_LINES} lines:\n' + '\n'.join(long)

MAX_SERVER_MODULE_LINES = 700   # the server's seams stay small enough to read: a new API gets a module of its own

def test_no_server_module_over_700_lines():
    long = [f'{m.name}: {n} lines' for m in sorted((ROOT / 'nanoserve' / 'server').glob('*.py'))
            if (n := len(m.read_text().splitlines())) > MAX_SERVER_MODULE_LINES]
    assert not long, f'server modules over {MAX_SERVER_MODULE_LINES} lines:\n' + '\n'.join(long)

def test_server_seams_import_only_earlier_seams():
    "Each server module imports only the seams before it (chapter order): the frontend never imports the launch."
    from nanoserve.server import _SEAMS
    for k, seam in enumerate(_SEAMS):
        text = (ROOT / 'nanoserve' / 'server' / f'{seam}.py').read_text()
        later = [s for s in _SEAMS[k + 1:] if re.search(rf'\bfrom (?:nanoserve\.server)?\.{s} import', text)]
        assert not later, f'server.{seam} imports later seams: {later}'

def test_package_is_pyflakes_clean():
    pytest.importorskip('pyflakes')
    r = subprocess.run([sys.executable, '-m', 'pyflakes', str(ROOT / 'nanoserve')], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout, r.stdout + r.stderr

@pytest.mark.parametrize('flag', ['--help', '--version'])
def test_top_level_flags_do_not_import_torch(flag):
    probe = (f'import sys\nfrom nanoserve.cli import main\n'
             f'try: main([{flag!r}])\nexcept SystemExit as e: code = e.code\n'
             'print("exit", code, "torch" in sys.modules, "transformers" in sys.modules)')
    r = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == 'exit 0 False False', r.stdout
