#!/usr/bin/env python3
"""Shares of a py-spy raw profile of a vLLM EngineCore (tools/gpu/runs/prof.sh writes them).

usage: tools/pyspy_shares.py FILE[.gz]
Prints, for the main thread's samples inside an engine step: each function's inclusive
share, the outermost kvedit frame's share and the hottest leaves."""
import collections
import gzip
import sys
path = sys.argv[1]
tot = collections.Counter(); main_step = 0; kv = collections.Counter(); leaf = collections.Counter(); fn = collections.Counter()
threads = collections.Counter()
opener = gzip.open if path.endswith(".gz") else open
for line in opener(path, "rt"):
    stack, _, n = line.rstrip().rpartition(' ')
    n = int(n)
    frames = stack.split(';')
    threads[frames[0][:60]] += n
    if 'MainThread' not in frames[0]: continue
    if not any('_process_engine_step' in f for f in frames): continue
    main_step += n
    seen = set()
    for f in frames:
        name = f.split(' (')[0]
        if name in seen: continue
        seen.add(name)
        fn[name] += n
    kvf = [f for f in frames if 'kvedit/' in f]
    if kvf:
        kv[kvf[0].split(' (')[0] + ' (' + kvf[0].split('(')[-1]] += n
    leaf[frames[-1]] += n
print('threads', threads.most_common(8))
print('main thread in engine step samples', main_step)
print('--- functions (inclusive share of step)')
for k, v in fn.most_common(45): print(f'{v/main_step:6.3f} {k}')
print('--- outermost kvedit frame')
for k, v in kv.most_common(25): print(f'{v/main_step:6.3f} {k}')
print('--- leaves')
for k, v in leaf.most_common(15): print(f'{v/main_step:6.3f} {k}')
