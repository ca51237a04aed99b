"""Start-up time of the commands that do not capture (acceptance: under 1 s).

    .venv/bin/python bench/cli_startup.py [--repeat 5]

Runs each command as a fresh process (the way users run it) several times
and prints the best and median wall time, plus whether torch was imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from flint.fuzz import write_seed_trace

    tmp = Path(tempfile.mkdtemp(prefix="flint-startup-"))
    trace = write_seed_trace(tmp / "trace")
    stg = ROOT / "tests" / "data" / "chakra" / "stg"
    commands = {
        "flint --help": [str(BIN / "flint"), "--help"],
        "flint inspect (4-rank trace)": [str(BIN / "flint"), "inspect", str(trace)],
        "flint inspect (stg trace)": [str(BIN / "flint"), "inspect", str(stg)],
        "flint estimate (trace)": [str(BIN / "flint"), "estimate", str(trace), "--network", "ring"],
        "flint-opt --help": [str(BIN / "flint-opt"), "--help"],
        "flint emit --help": [str(BIN / "flint"), "emit", "--help"],
    }
    import resource

    print(f"{'command':<32} {'best wall (s)':>14} {'median wall (s)':>16} {'CPU (s)':>8} {'torch imported':>15}")
    worst = 0.0
    for name, cmd in commands.items():
        times, cpu = [], []
        for _ in range(args.repeat):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, FLINT_PROGRESS="0"))
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        module = "flint.tools.flint_opt" if "flint-opt" in cmd[0] else "flint.tools.flint_cli"
        check = subprocess.run([sys.executable, "-c", f"import sys; from {module} import main\n"
                                f"try:\n    main({cmd[1:]!r})\nexcept SystemExit:\n    pass\n"
                                "print('torch' in sys.modules, file=sys.stderr)"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        torch = check.stderr.strip().splitlines()[-1] if check.stderr.strip() else "?"
        best = min(times)
        worst = max(worst, best)
        print(f"{name:<32} {best:>14.2f} {statistics.median(times):>16.2f} {min(cpu):>8.2f} {torch:>15}")
    print(f"\nslowest best wall time {worst:.2f} s ({'under' if worst < 1 else 'NOT under'} 1 s); "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (wall time grows with the load; "
          "CPU time does not)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
