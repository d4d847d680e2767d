"""`nanoserve bench quant` end to end on the tiny model and its Q4_1 GGUF file: every weight format, the figures and
ratios it stores, the targets it marks, the command and chapter 15a's reading of its JSON, and llama.cpp beside it
when llama-cpp-python is installed. Structure only: no figure is held to a wall-clock bound."""
import importlib.util, json, math
import pytest
from nanoserve.bench import result_table
from nanoserve.bench_quant import QUANT_FORMATS, QUANT_TARGETS, llama_cpp_peer, quant_benchmark
from nanoserve.bench_cli import main
from nanoserve.results import quant_target_rows
from nanoserve.testing import save_tiny_gguf, save_tiny_model

SMALL = dict(text_tokens=48, prompt_len=4, new_tokens=5, batch_size=2, repeats=2, page_size=4)

@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "The tiny model's directory and the same weights as a Q4_1 GGUF file."
    root = tmp_path_factory.mktemp('quant')
    model = save_tiny_model(root/'tiny', tokenizer=True)
    return model, save_tiny_gguf(model, root/'tiny.Q4_1.gguf', 'Q4_1')

@pytest.fixture(scope='module')
def measured(tiny):
    model, gguf = tiny
    return quant_benchmark(model, gguf, peer=False, **SMALL)

def test_every_format_measured(measured):
    rows = {r['format']: r for r in measured['formats']}
    assert list(rows) == list(QUANT_FORMATS) and measured['llama_cpp'] is None
    fp32 = rows['fp32']
    for r in rows.values():
        for figure in ('batch1', 'batched'):
            assert len(r[figure]['runs']) == 2 and r[figure]['best'] == max(r[figure]['runs']) > 0
            assert min(r[figure]['runs']) <= r[figure]['median'] <= r[figure]['best']
        assert r['batch1_vs_fp32'] == r['batch1']['best'] / fp32['batch1']['best']
        assert r['batched_vs_fp32'] == r['batched']['best'] / fp32['batched']['best']
        assert math.isfinite(r['perplexity']) and r['perplexity'] > 1
        assert r['ppl_change'] == r['perplexity'] / measured['reference']['perplexity'] - 1
        assert r['resident_vs_file'] == r['rss_growth_bytes'] / measured['gguf_bytes']
        assert r['batch1_vs_llama_cpp'] is None and r['load_s'] > 0
    assert fp32['quantized_kernels'] == {}
    for fmt in ('gguf', 'int8', 'int4'):
        assert rows[fmt]['quantized_kernels'] and rows[fmt]['tensor_bytes'] < fp32['tensor_bytes']
    assert abs(rows['gguf']['ppl_change']) < 1e-4      # the file's own blocks: transformers' reading of the same file

def test_targets_marked_from_the_figures(measured):
    assert [t['name'] for t in measured['targets']] == [t.name for t in QUANT_TARGETS]
    for t in measured['targets']:
        assert (t['value'] is None) == (t['met'] is None) == ('llama.cpp' in t['name'])   # no peer, no verdict
        if t['met'] is not None: assert t['met'] == (t['value'] <= t['bound'] if t['at_most'] else t['value'] >= t['bound'])
    table = result_table(dict(measured, benchmark='quant'))
    assert [line.split()[0] for line in table.splitlines()[2:7]] == [*QUANT_FORMATS, 'batch']   # no llama.cpp row

def test_perplexity_repeats(tiny, measured):
    model, gguf = tiny
    again = quant_benchmark(model, gguf, formats=('fp32', 'int8'), peer=False, **dict(SMALL, repeats=1))
    first = {r['format']: r['perplexity'] for r in measured['formats']}
    assert {r['format']: r['perplexity'] for r in again['formats']} == {f: first[f] for f in ('fp32', 'int8')}
    assert again['reference'] == measured['reference']

def test_command_and_results_chapter(tiny, tmp_path):
    model, gguf = tiny
    out = tmp_path/'quant.json'
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert main(['quant', '--model', str(model), '--gguf', str(gguf), '--formats', 'fp32', 'gguf', '--no-peer', *flags,
                 '--json', str(out)]) == 0
    res = json.loads(out.read_text())
    assert res['benchmark'] == 'quant' and [r['format'] for r in res['formats']] == ['fp32', 'gguf']
    rows = {row[0]: row for row in quant_target_rows({'quant': [res, res]})}
    assert rows['gguf batch-1 decode / llama.cpp'][4:6] == ('not measured', 'run 1, 2: llama.cpp: not run')
    assert rows['int8 batch-1 decode / fp32'][4] == 'not measured'
    assert rows['gguf perplexity against the reference, either way'][4] == 'met'

def test_llama_cpp_beside(tiny):
    "llama.cpp on the same file: its figures, or why not (absent, or a build that fails here), never an exception."
    _, gguf = tiny
    peer = llama_cpp_peer(gguf, [5, 6, 7, 8], list(range(5, 45)), new_tokens=4, repeats=1)
    if importlib.util.find_spec('llama_cpp') is None: assert peer['absent'] == 'llama_cpp is not installed'
    elif 'absent' in peer: assert peer['absent'].startswith('its process failed')
    else: assert peer['batch1']['best'] > 0 and math.isfinite(peer['perplexity']) and peer['threads'] >= 1
