"""Run a command while another process keeps one CPU core busy: `make test-busy`.

    python tools/busy.py -- COMMAND ...

The suite must hold on a shared machine (tests wait for events, never for a fixed time); this makes
that condition on purpose. The spinner runs at the same priority as the tests and is killed when
the command ends, whatever its exit code, which is passed on.
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: busy.py -- COMMAND ...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    print(f"busy.py: pid {spinner.pid} keeps one core busy while `{' '.join(command)}` runs", flush=True)
    try:
        return subprocess.call(command)
    finally:
        spinner.kill()
        spinner.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
