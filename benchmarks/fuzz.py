"""A large fuzz run (gac_torch.tools.fuzz) split over worker processes, summarized as markdown.

    nice python benchmarks/fuzz.py --cases 2000 --seed 0 --target cpu --jobs 2 \
        --md benchmarks/results/fuzz_<date>_cpu.md

Every failure is attributed to the known bug class (tests/test_fuzz.py's KNOWN: issue 12's open
items) its program exercises, or listed as new; the repro files go to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_fuzz import KNOWN  # noqa: E402  (tests/ on the path first)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default="fuzz_repros")
    ap.add_argument("--max-seconds", type=float, default=None, help="each job starts no case after this")
    ap.add_argument("--merge", action="store_true",
                    help="run nothing: summarize the job*.jsonl already in --out (seeds deduplicated)")
    ap.add_argument("--commit", default=None, help="with --merge: the commit the jobs ran")
    ap.add_argument("--minutes", type=float, default=None, help="with --merge: the run's wall time")
    ap.add_argument("--md", default=None, help="write the markdown summary here")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    per = -(-args.cases // args.jobs)
    start = time.time()
    commit = f"{_git('rev-parse', '--short', 'HEAD')} ({_git('log', '-1', '--format=%cd', '--date=iso')})"
    dirty = " plus uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
    if args.merge:
        commit, dirty = args.commit or commit, ""
    procs, logs = [], []
    for j in range(0 if args.merge else args.jobs):
        n = min(per, args.cases - j * per)
        log = os.path.join(args.out, f"job{j}.jsonl")
        if os.path.exists(log):
            os.remove(log)
        logs.append(log)
        cmd = [sys.executable, "-m", "gac_torch.tools.fuzz", "--cases", str(n), "--seed", str(args.seed + j * per),
               "--target", args.target, "--out", args.out, "--json", log]
        if args.max_seconds is not None:
            cmd += ["--max-seconds", str(args.max_seconds)]
        with open(log + ".txt", "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                              filter(None, [ROOT, os.environ.get("PYTHONPATH")])))))
    for p in procs:
        p.wait()
    if args.merge:
        logs = sorted(os.path.join(args.out, n) for n in os.listdir(args.out)
                      if n.startswith("job") and n.endswith(".jsonl"))
    by_seed = {}
    for log in logs:
        with open(log) as f:
            for ln in f:
                rec = json.loads(ln)
                by_seed.setdefault(rec["seed"], rec)
    records = [by_seed[s] for s in sorted(by_seed)]
    minutes = args.minutes if args.merge and args.minutes else (time.time() - start) / 60

    counts = collections.Counter(r["status"] for r in records)
    line = (f"fuzz: {len(records)} cases, ok {counts['ok']}, mismatch {counts['mismatch']}, "
            f"crash {counts['crash']}, unsupported {counts['unsupported']}")
    by_class: dict[str, list] = collections.defaultdict(list)
    for r in records:
        if r["status"] in ("mismatch", "crash"):
            known = [k for k in KNOWN if k in r["features"]]
            by_class[", ".join(known) if known else "NEW (not in KNOWN)"].append(r)
    rejected = collections.Counter(re.sub(r": \d+ node\(s\),", ":", u) for r in records
                                   for u in set(r["unsupported"]))

    md = [f"# Fuzz run, target {args.target}", "",
          (f"Commit {commit}{dirty}, {args.jobs} job(s), {minutes:.0f} min; seeds {records[0]['seed']}.."
           f"{records[-1]['seed']}."), "",
          (f"    nice python benchmarks/fuzz.py --cases {args.cases} --seed {args.seed} --target {args.target} "
           f"--jobs {args.jobs}"), "", "```", line, "```", "",
          ("Each case: torch.compile(backend=\"gac\") and gac_torch.compile(torch.export.export(...)), strict "
           "mode, and default mode where strict did not compile everything; compared with eager "
           "(gac_torch/tools/fuzz/oracle.py)."), "",
          ("## Failures by known bug class (tests/test_fuzz.py KNOWN; a case is listed under every class "
           "it exercises)"),
          "", "| class | cases | mismatch | crash | example seeds | first detail |", "|---|---|---|---|---|---|"]
    for cls, rs in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        c = collections.Counter(r["status"] for r in rs)
        why = "; ".join(KNOWN[k] for k in cls.split(", ") if k in KNOWN) or "see the details below"
        detail = rs[0]["detail"][:120].replace("|", "/")
        md.append(f"| {cls} ({why}) | {len(rs)} | {c['mismatch']} | {c['crash']} | "
                  f"{', '.join(str(r['seed']) for r in rs[:6])} | {rs[0]['config']}: {detail} |")
    new = by_class.get("NEW (not in KNOWN)", [])
    if new:
        md += ["", "## Failures outside the known classes", ""]
        md += [f"- seed {r['seed']} {r['status']} ({r['config']}): {r['detail']}" for r in new]
    if rejected:
        md += ["", "## Rejected with GacUnsupportedError in strict mode (cases per op)", ""]
        md += [f"- {n}: {u}" for u, n in rejected.most_common()]
    text = "\n".join(md) + "\n"
    if args.md:
        os.makedirs(os.path.dirname(args.md) or ".", exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
