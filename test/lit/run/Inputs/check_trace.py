"""Summarizes a funcol Chrome trace per rank, for FileCheck: track names, span counts, iterations."""
import json
import sys

with open(sys.argv[1]) as f:
    trace = json.load(f)
events = trace["traceEvents"]
ranks = sorted({e["pid"] for e in events})
for r in ranks:
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["pid"] == r and e["ph"] == "M" and e["name"] == "thread_name"}
    print("rank %d: %s %s" % (r, names.get(0), names.get(1)))
    spans = [e for e in events if e["pid"] == r and e["ph"] == "X"]
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0, e
        assert e["tid"] == (1 if e["cat"] == "communication" else 0), e
    count = lambda cat: sum(1 for e in spans if e["cat"] == cat)
    iterations = len({e["args"]["iteration"] for e in spans})
    print("rank %d spans: compute %d wait %d communication %d iterations %d"
          % (r, count("compute"), count("wait"), count("communication"), iterations))
