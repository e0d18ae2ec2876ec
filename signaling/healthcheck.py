"""`python -m signaling.healthcheck [--config F] [--url U]`: exit 0 when the server answers GET /readyz
with 200, else 1 (loading, draining, stopped, unreachable). The container's HEALTHCHECK runs it; it
needs nothing but the standard library and the config file the server was started with."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from voicertc.config import load_config

WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def readyz_url(config_path: str | None) -> str:
    """Where the server of `config_path` answers /readyz from inside its own host (a wildcard bind
    is reached on loopback)."""
    server = load_config(config_path).server
    host = WILDCARDS.get(server.host, server.host)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.port}/readyz"


def check(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"{resp.status} {resp.read(200).decode(errors='replace')}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code} {exc.read(200).decode(errors='replace')}"
    except OSError as exc:
        return False, f"unreachable: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m signaling.healthcheck", description=__doc__)
    parser.add_argument("--config", help="the server's config.toml (its [server] host and port)")
    parser.add_argument("--url", help="the /readyz URL (instead of --config)")
    args = parser.parse_args(argv)
    url = args.url or readyz_url(args.config)
    ok, detail = check(url)
    sys.stdout.write(f"{url}: {detail.strip()}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
