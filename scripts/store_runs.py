#!/usr/bin/env python3
"""Redo the stored benchmark runs that chapter 15a (and chapter 17) read: every benchmark three times, in rounds
(each round runs every benchmark once, so a change of the machine over time shows as spread, not as a bias of
one benchmark), each run started only once the machine is quiet: its one-minute load average under --quiet
(default 0.8), so the load each run records (`environment.load_average`, taken as it starts) is the machine's
other work, not the tail of the run before it. Run k of benchmark NAME goes to nbs/bench_results/NAME.k.json.
The plots of chapter 15a are then drawn from the first run of each.

Usage: python scripts/store_runs.py [--runs 3] [--only NAME ...] [--first-run 1]
Names: see RUNS below (a full round takes about half an hour on 2 cores, replicas being the longest; quant runs
SmolLM2 in four weight formats beside llama.cpp when llama-cpp-python is installed)."""
import argparse, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONLINE_STEADY = ['online', '--rate', '1', '--input-len', '130', '260', '--output-len', '40', '40', '--num-requests', '32']
ONLINE_OVERLOAD = ['online', '--rate', '3.333', '--input-len', '200', '400', '--output-len', '40', '40',
                   '--num-requests', '32']
PREFILL_FIRST = ['--batch-policy', 'prefill-first', '--max-num-batched-tokens', '8192']
RUNS = {     # name: the command, less where its JSON goes ('bench' means `nanoserve bench`)
    'random': ['bench', 'random'],
    'shared-prefix': ['bench', 'shared-prefix'],
    'decode': ['bench', 'decode'],
    'scheduler': ['bench', 'scheduler'],
    'step-cost': ['bench', 'step-cost'],
    'ablations': ['bench', 'ablations', '--num-requests', '32'],
    'online-1rps': ['bench', *ONLINE_STEADY],
    'online-1rps-before': ['bench', *ONLINE_STEADY, *PREFILL_FIRST],
    'online-overload': ['bench', *ONLINE_OVERLOAD],
    'online-overload-before': ['bench', *ONLINE_OVERLOAD, *PREFILL_FIRST],
    'structured': ['bench', 'structured', '--input-len', '32', '64'],
    'quant': ['bench', 'quant'],
    'spec': ['bench', 'spec'],
    'moe': ['bench', 'moe'],
    'cpu-ablations': ['script', 'cpu_ablations.py', '32'],
    'replicas': ['script', 'replica_bench.py'],
}

def command(name: str, out: Path) -> list[str]:
    "The command line of one run of benchmark `name`, writing its JSON to `out`."
    kind, *args = RUNS[name]
    if kind == 'bench': return [str(Path(sys.executable).parent / 'nanoserve'), 'bench', *args, '--json', str(out)]
    script, *args = args
    flag = '--out' if script == 'replica_bench.py' else '--json'
    return [sys.executable, str(ROOT / 'scripts' / script), *args, flag, str(out)]

def wait_until_quiet(threshold: float, poll_s: float = 5.0):
    "Block until the one-minute load average is under `threshold`."
    while os.getloadavg()[0] >= threshold: time.sleep(poll_s)

def draw_plots(results_dir: Path, images_dir: Path):
    "Chapter 15a's three figures, from the first stored run of each benchmark they show."
    from nanoserve.results import load_runs, plot_ablations, plot_decode_sweep, plot_stream_times
    first = {name: runs[0] for name, runs in load_runs(results_dir).items()}
    plot_decode_sweep(first['decode'], images_dir / 'bench_decode.png')
    plot_ablations(first['ablations'], images_dir / 'bench_ablations.png')
    before, after = first['online-overload-before']['runs'][0], first['online-overload']['runs'][0]
    plot_stream_times({'before: prefill-first': before, 'after: mixed, 32-token budget': after},
                      images_dir / 'bench_online_stream.png',
                      title='overload: the stream that waited longest before, in both runs')

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--runs', type=int, default=3, help='runs of each benchmark (default: 3)')
    p.add_argument('--first-run', type=int, default=1, help='number of the first run (to add rounds; default: 1)')
    p.add_argument('--only', nargs='+', choices=list(RUNS), help='these benchmarks only (default: all)')
    p.add_argument('--quiet', type=float, default=0.8, help='start a run under this load average (default: 0.8)')
    p.add_argument('--out', default=str(ROOT / 'nbs' / 'bench_results'))
    p.add_argument('--no-plots', action='store_true', help='do not redraw the plots of chapter 15a')
    args = p.parse_args(argv)
    out = Path(args.out)
    for run in range(args.first_run, args.first_run + args.runs):
        for name in args.only or RUNS:
            wait_until_quiet(args.quiet)
            start = time.monotonic()
            cmd = command(name, out / f'{name}.{run}.json')
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            took = time.monotonic() - start
            print(f'run {run} of {name}: exit {done.returncode} in {took:.0f} s', flush=True)
            if done.returncode: print(done.stderr[-3000:], file=sys.stderr, flush=True)
    if not args.no_plots: draw_plots(out, ROOT / 'nbs' / 'images')
    return 0

if __name__ == '__main__': sys.exit(main())
