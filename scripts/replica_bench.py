#!/usr/bin/env python3
"""Chapter 17's measurement: chapter 15's shared-prefix workload sent to `nanoserve serve` on Ray Serve with one engine
replica, and with two under prefix-aware routing and under Ray Serve's default routing. Each configuration gets a
server of its own, a warm-up run on other prefixes, then the measured run (`measure_endpoint`): the prefix-cache hit
rate the replicas report in `usage` and the output tokens per second. The results go to
nbs/bench_results/replicas.json, from which chapter 17's table is computed. Needs Ray (`pip install nanoserve[ray]`).

Usage: python scripts/replica_bench.py [--model smollm2] [--groups 8 --per-group 8 --prefix-len 512 ...]"""
import argparse, json, subprocess, sys
from pathlib import Path
from nanoserve.bench import environment, shared_prefix_workload
from nanoserve.checkpoints import resolve_model, smollm2_path
from nanoserve.replicas import ROUTINGS, measure_endpoint
from nanoserve.testing import ServerProcess

CONFIGS = [(1, 'prefix'), (2, 'prefix'), (2, 'ray')]     # (engine replicas, routing)

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='smollm2', help="model directory, hub id or 'smollm2' (default: smollm2)")
    p.add_argument('--device', default='auto')
    p.add_argument('--groups', type=int, default=8, help='shared prefixes (default: 8)')
    p.add_argument('--per-group', type=int, default=8, help='questions per prefix (default: 8)')
    p.add_argument('--prefix-len', type=int, default=512)
    p.add_argument('--question-len', type=int, default=32)
    p.add_argument('--output-len', type=int, default=32)
    p.add_argument('--concurrency', type=int, default=16, help='requests in flight (default: 16)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--verbose', action='store_true', help="show the servers' logs")
    p.add_argument('--out', default=str(Path(__file__).parent.parent / 'nbs/bench_results/replicas.json'))
    args = p.parse_args(argv)
    model = str(smollm2_path(verbose=True)) if args.model == 'smollm2' else resolve_model(args.model, verbose=True)
    shape = (args.per_group, args.prefix_len, args.question_len, args.output_len)
    workload = shared_prefix_workload(args.groups, *shape, seed=args.seed)
    warm_up = shared_prefix_workload(2, *shape, seed=args.seed + 1)      # other prefixes: warms the code, not the cache
    env, runs = environment(), []
    for replicas, routing in CONFIGS:
        assert routing in ROUTINGS
        with ServerProcess(model, cli=True, served_model_name='bench', startup_timeout=600.0, device=args.device,
                           stderr=None if args.verbose else subprocess.DEVNULL, data_parallel_size=replicas,
                           routing=routing) as server:
            measure_endpoint(server.url, warm_up, 'bench', args.concurrency)
            result = measure_endpoint(server.url, workload, 'bench', args.concurrency)
        runs.append(dict(replicas=replicas, routing=routing, **result))
        print(f"{replicas} replica(s), {routing} routing: hit rate {result['hit_rate']:.1%}, "
              f"{result['tokens_per_s']:.1f} output tok/s ({result['seconds']:.1f} s)", flush=True)
    setup = (f"{Path(model).name} on {env['cpus']} CPU cores ({env['device']}, {env['threads']} torch threads per engine, "
             f"load average {env['load_average']} at the start); shared-prefix workload: {args.groups} prefixes of "
             f"{args.prefix_len} tokens x {args.per_group} questions of {args.question_len} tokens, {args.output_len} "
             f"output tokens each, {args.concurrency} in flight")
    results = dict(setup=setup, argv=sys.argv[1:] if argv is None else argv, environment=env,
                   workload=dict(requests=workload.num_requests, input_tokens=workload.input_tokens,
                                 output_tokens=workload.output_tokens), runs=runs)
    Path(args.out).write_text(json.dumps(results, indent=1) + '\n')
    print(f'wrote {args.out}')
    return 0

if __name__ == '__main__': sys.exit(main())
