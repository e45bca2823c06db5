"""Tabulate the doctor's testbed runs (docs/doctor/testbed-runs.sh) as Markdown.

    python docs/doctor/summarize.py docs/doctor/testbed > docs/doctor/testbed/summary.md

A run is *right* when the ranks it flags are exactly the degraded ones (for the node
scenario: the ranks of node r1, with the node named degraded), each flagged rank's (or
node's) fraction is within 0.1 of the truth, and the exit status says so (3 degraded,
0 healthy).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# scenario -> (truth per rank, degraded node name or None, its fraction)
TRUTH = {
    "one-0.5": ({0: 0.5}, None),
    "healthy": ({}, None),
    "two": ({0: 0.5, 3: 0.7}, None),
    "node": ({2: 0.5, 3: 0.5}, ("r1", 0.5)),
}


def judge(name: str, data: dict) -> tuple[bool, dict]:
    truth, node = TRUTH[name]
    flagged = {r["rank"] for r in data["ranks"] if r["verdict"] != "healthy"}
    ok = flagged == set(truth)
    fracs = {}
    for r in data["ranks"]:
        if r["rank"] in truth:
            fracs[r["rank"]] = r["fraction"]
            if node is None:
                ok &= abs(r["fraction"] - truth[r["rank"]]) <= 0.1
    if node is not None:
        row = next(n for n in data["nodes"] if n["name"] == node[0])
        fracs["node"] = row["fraction"]
        ok &= row["verdict"] == "degraded" and abs(row["fraction"] - node[1]) <= 0.1
        ok &= f"node {node[0]}" in data["summary"]
    ok &= data["exit_status"] == (3 if truth else 0)
    healthy = [r["fraction"] for r in data["ranks"] if r["rank"] not in truth]
    return ok, {"fracs": fracs, "lowest_healthy": min(healthy), "seconds": data["seconds"]}


def main(folder: str) -> None:
    runs: dict[str, list[tuple[int, bool, dict]]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        m = re.match(r"(.+)-(\d+)$", path.stem)
        if not m or m.group(1) not in TRUTH:
            continue
        ok, info = judge(m.group(1), json.loads(path.read_text()))
        runs.setdefault(m.group(1), []).append((int(m.group(2)), ok, info))
    print("| scenario | truth | right | measured fraction of the degraded (min-max) "
          "| lowest healthy rank | seconds (min-max) |")
    print("|---|---|---|---|---|---|")
    for name in TRUTH:
        rows = sorted(runs.get(name, []))
        if not rows:
            continue
        right = sum(ok for _, ok, _ in rows)
        keys = sorted({k for _, _, i in rows for k in i["fracs"]}, key=str)
        meas = "; ".join(
            f"{'node r1' if k == 'node' else f'rank {k}'}: "
            f"{min(i['fracs'][k] for _, _, i in rows):.2f}-"
            f"{max(i['fracs'][k] for _, _, i in rows):.2f}"
            for k in keys
        ) or "-"
        truth, node = TRUTH[name]
        what = (
            f"node {node[0]} at {node[1]}" if node
            else ", ".join(f"rank {r} at {f}" for r, f in truth.items()) or "healthy"
        )
        low = min(i["lowest_healthy"] for _, _, i in rows)
        secs = [i["seconds"] for _, _, i in rows]
        print(f"| {name} | {what} | {right} of {len(rows)} | {meas} | {low:.2f} "
              f"| {min(secs):.1f}-{max(secs):.1f} |")
    print()
    print("Per run (fractions of the degraded ranks, or node; the lowest healthy rank):")
    print()
    for name in TRUTH:
        for i, ok, info in sorted(runs.get(name, [])):
            fr = ", ".join(f"{k}: {v:.2f}" for k, v in info["fracs"].items())
            print(f"- {name} {i}: {'right' if ok else 'WRONG'}; {fr or '-'}; lowest healthy "
                  f"{info['lowest_healthy']:.2f}; {info['seconds']:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/doctor/testbed")
