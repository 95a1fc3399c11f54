"""Two builds of spillway-bench, alternated job by job (A B, then B A, ...): each job's figures per
build, and the per-pair ratio A/B, so a drifting machine moves both sides of a pair alike.

usage: bench/compare-builds.py NEW_BINARY OLD_BINARY [ROUNDS] [JOB ...]
A build of another commit: git worktree add /tmp/old <rev> && (cd /tmp/old &&
CARGO_TARGET_DIR=/tmp/old-target cargo build --release -p spillway-bench).
"""
import json
import re
import statistics
import subprocess
import sys

NEW, OLD = sys.argv[1], sys.argv[2]
jobs = {
 'default (write+randread 64KiB 256MiB)': [],
 'spill-unspill 4KiB': ['--rw','spill-unspill','--bs','4KiB','--size','256MiB','--target','16MiB','--dir','/var/tmp/sw-bench','--loops','1'],
 'spill-unspill 64KiB': ['--rw','spill-unspill','--bs','64KiB','--size','256MiB','--target','16MiB','--dir','/var/tmp/sw-bench','--loops','1'],
 'spill-unspill 1MiB': ['--rw','spill-unspill','--bs','1MiB','--size','512MiB','--target','64MiB','--loops','1'],
 'spill-unspill 16MiB': ['--rw','spill-unspill','--bs','16MiB','--size','1GiB','--target','64MiB','--loops','1'],
 'randread 4KiB qd32 direct': ['--rw','randread','--bs','4KiB','--size','512MiB','--iodepth','32','--direct','--backend','uring'],
 'write 1MiB qd16 direct': ['--rw','write','--bs','1MiB','--size','2GiB','--iodepth','16','--direct','--backend','uring'],
}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
sel = sys.argv[4:] or list(jobs)
def parse(out):
    r={}
    for line in out.splitlines():
        m=re.match(r'\s+(write|read)\s+([\d.]+) (\w+)/s\s+(\d+) IOPS', line)
        if m:
            r[m.group(1)+' IOPS']=float(m.group(4))
        m=re.match(r'\s+(spill|unspill)\s+spillway\s+(\d+) ops/s.*file-per-key\s+(\d+) ops/s.*ratio ([\d.]+)x', line)
        if m:
            r[m.group(1)+' ops/s']=float(m.group(2)); r[m.group(1)+' ratio']=float(m.group(4))
    return r
res={}
for job in sel:
    for rnd in range(rounds):
        order = [('new',NEW),('old',OLD)] if rnd%2==0 else [('old',OLD),('new',NEW)]
        for name,b in order:
            subprocess.run(['rm','-rf','/var/tmp/sw-bench'])
            out=subprocess.run([b]+jobs[job], capture_output=True, text=True, timeout=900).stdout
            p=parse(out)
            for k,v in p.items(): res.setdefault(job,{}).setdefault(k,{}).setdefault(name,[]).append(v)
            print(job, rnd, name, p, flush=True)
print('\nSUMMARY (median new/old, per-pair ratios)')
for job,d in res.items():
    for k,v in d.items():
        n,o=v.get('new',[]),v.get('old',[])
        if not n or not o: continue
        pr=[a/b for a,b in zip(n,o) if b]
        print(f'{job:40s} {k:14s} new {statistics.median(n):12.1f} old {statistics.median(o):12.1f}  new/old median {statistics.median(pr):.3f}  pairs {[round(x,2) for x in pr]}')
