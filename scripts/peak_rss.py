#!/usr/bin/env python3
"""Runs a command and samples its resident memory from /proc every 20 ms, split as the kernel
splits it: anonymous (heap, copies) and file-backed (mapped pages of the weights file).

usage: peak_rss.py OUT.json -- COMMAND [ARGS...]

Writes {"peak_anon_mib", "peak_file_mib", "peak_total_mib", "wall_s", "rc"} to OUT.json and
exits with the command's status. The peak of the sum is sampled as a sum (the two peaks need
not coincide). Used by bench-vs-llamacpp.sh for both engines, so both are measured alike.
"""
import json
import subprocess
import sys
import time


def sample(pid):
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(rest.split()[0]) / 1024.0
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    if "RssAnon" not in fields:
        return None
    return fields["RssAnon"], fields.get("RssFile", 0.0) + fields.get("RssShmem", 0.0)


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    out, cmd = sys.argv[1], sys.argv[3:]
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    anon = file = total = 0.0
    while proc.poll() is None:
        s = sample(proc.pid)
        if s:
            anon, file, total = max(anon, s[0]), max(file, s[1]), max(total, s[0] + s[1])
        time.sleep(0.02)
    rec = {"peak_anon_mib": round(anon, 1), "peak_file_mib": round(file, 1), "peak_total_mib": round(total, 1),
           "wall_s": round(time.monotonic() - start, 2), "rc": proc.returncode}
    with open(out, "w") as f:
        json.dump(rec, f)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
