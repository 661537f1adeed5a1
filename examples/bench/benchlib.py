"""Pieces every benchmark script in examples/bench shares: naming the machine, running a job
on 1..N ranks (loom-launch over gloo, or mpirun over mpi) and reading its metrics, and
replacing a benchmark's marked section of docs/BENCHMARKS.md with its new table."""
import json
import os
import platform
import shutil
import subprocess
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LOOM = os.path.join(ROOT, "build/bin/loom")
LAUNCH = os.path.join(ROOT, "build/bin/loom-launch")
_port = [29500 + os.getpid() % 400]


def run_loom(job, sets, ranks=1, backend="gloo", quiet=True):
    """Runs `loom run job --set ...` on `ranks` processes (one: directly; gloo: loom-launch on
    a fresh port; mpi: mpirun --oversubscribe) in a fresh output folder, and returns the rows
    of its metrics.jsonl (the folder is removed). Raises CalledProcessError when the run
    fails."""
    out = tempfile.mkdtemp(prefix="loom-bench-")
    try:
        sets = [*sets, f"train.output_dir={out}"]
        args = [LOOM, "run", job] + [x for s in sets for x in ("--set", s)]
        env = dict(os.environ)
        if ranks == 1:
            cmd = args
        elif backend == "gloo":
            _port[0] += 1
            cmd = [LAUNCH, "--nproc-per-node", str(ranks), "--master-port", str(_port[0])] + args
        elif backend == "mpi":
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + args + [
                "--set", 'distributed.backend="mpi"']
        else:
            raise ValueError(f"backend {backend!r}: use gloo or mpi")
        subprocess.run(cmd, check=True, env=env,
                       stdout=subprocess.DEVNULL if quiet else None)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    finally:
        shutil.rmtree(out, ignore_errors=True)


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
