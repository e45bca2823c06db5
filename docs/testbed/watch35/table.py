"""Issue 35 on the testbed: what the watch adopted, when, and what each probe found.

    python docs/testbed/watch35/table.py docs/testbed/watch35

Reads every ``transition-p*.jsonl`` (rows of ``optcc-mpi lab transition``: healthy,
degraded, recovered phases) and the links log beside it (``linklog-p*.jsonl``: the
watch's ``adopt`` and ``probe`` records), and prints one markdown row per run: the truth
of the degraded phase; per phase, each adoption as the call counted from the phase's
start and the profile adopted; the probes (call: what it found, whether the watch
adopted it, its seconds).
"""

import json
import sys
from pathlib import Path


def main(folder):
    print(
        "| p | truth (degraded phase) | healthy phase | degraded phase: call, adopted | "
        "recovered phase: call, adopted | probes (call: found, adopted or kept, seconds) |"
    )
    print("|---|---|---|---|---|---|")
    for f in sorted(Path(folder).glob("transition-p*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        phase_of = {r["call"]: r["phase"] for r in rows}
        start = {}
        for r in rows:
            start.setdefault(r["phase"], r["call"])
        truth = next(r["truth"] for r in rows if r["phase"] == "degraded")
        log = f.with_name(f.name.replace("transition-", "linklog-"))
        events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        cells = {ph: [] for ph in ("healthy", "degraded", "recovered")}
        probes = []
        for e in events:
            ph = phase_of.get(e.get("call"))
            if e["event"] == "adopt" and ph:
                cells[ph].append(f"{e['call'] - start[ph] + 1}: `{e['links']}`")
            if e["event"] == "probe":
                mark = "adopted" if e["adopted"] else "kept"
                probes.append(f"{e['call']}: `{e['links']}` {mark}, {e['seconds']:.1f} s")
        row = [str(rows[0]["p"]), f"`{truth}`"]
        row += ["; ".join(cells[ph]) or "nothing" for ph in ("healthy", "degraded", "recovered")]
        row.append("; ".join(probes) or "none")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
