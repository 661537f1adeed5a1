"""Pieces every benchmark script in examples/bench shares: naming the machine, and replacing
a benchmark's marked section of docs/BENCHMARKS.md with its new table."""
import os
import platform

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write_section(name, text):
    """Replaces what stands between <!-- NAME:begin --> and <!-- NAME:end --> in
    docs/BENCHMARKS.md with `text`."""
    path = os.path.join(ROOT, "docs/BENCHMARKS.md")
    doc = open(path).read()
    start, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = doc.index(start) + len(start), doc.index(end)
    with open(path, "w") as f:
        f.write(doc[:i] + "\n" + text + "\n" + doc[j:])
