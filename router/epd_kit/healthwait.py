"""Block until an HTTP endpoint answers 200, for systemd ExecStartPost readiness gates.

    python -m epd_kit.healthwait URL TIMEOUT_S [--interval S]

Stdlib only (it runs before anything else of the kit is needed). Exit 0 once URL answers
200; exit 1 when TIMEOUT_S passes, or at once when the unit's main process (systemd puts
its pid in $MAINPID for ExecStartPost) has died, so a crashed engine fails fast instead of
holding the unit in "activating" until the timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request


def _main_process_gone() -> bool:
    pid = os.environ.get("MAINPID", "")
    return pid.isdigit() and int(pid) > 0 and not os.path.exists(f"/proc/{pid}")


def _answers_200(url: str, probe_timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=probe_timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_healthy(url: str, timeout_s: float, interval_s: float = 1.0) -> bool:
    """Poll url until it answers 200 (True) or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if _answers_200(url, probe_timeout_s=min(5.0, max(interval_s, 0.5))):
            return True
        if _main_process_gone():
            print(
                f"healthwait: main process {os.environ.get('MAINPID')} exited before {url} was ready", file=sys.stderr
            )
            return False
        if time.monotonic() + interval_s > deadline:
            print(f"healthwait: {url} not ready after {timeout_s:g} s", file=sys.stderr)
            return False
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_kit.healthwait", description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("timeout_s", type=float)
    parser.add_argument("--interval", type=float, default=1.0, dest="interval_s")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.interval_s <= 0:
        parser.error("timeout_s and --interval must be positive")
    return 0 if wait_until_healthy(args.url, args.timeout_s, args.interval_s) else 1


if __name__ == "__main__":
    sys.exit(main())
