"""Fetch each pool's tokenizer files from the Hugging Face Hub (the gateway's init step).

Usage: python fetch_tokenizers.py --dest DIR NAME=REPO@REVISION [...]

Writes DIR/NAME/{tokenizer.json, tokenizer_config.json, chat_template.jinja} (the last two
when the repository has them), each file atomically, then DIR/NAME/.complete. A directory
already complete for the same REPO@REVISION is left alone. HF_ENDPOINT (default
https://huggingface.co) selects the Hub or a mirror; HF_TOKEN authorises gated repositories.
Standard library only: it runs in the kvroute image before the gateway starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REQUIRED = ("tokenizer.json",)
OPTIONAL = ("tokenizer_config.json", "chat_template.jinja")
ATTEMPTS = 5


class FetchError(Exception):
    pass


def fetch(url: str, token: str | None, timeout: float = 60.0) -> bytes | None:
    """The body at ``url``; None on 404; retries transient failures."""
    headers = {"User-Agent": "kvroute-fetch-tokenizers"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    delay = 1.0
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=timeout
            ) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            if exc.code in (401, 403):
                hint = "set huggingface.tokenSecretRef" if not token else "check the token's access"
                raise FetchError(
                    f"{url}: HTTP {exc.code} (gated or private repository? {hint})"
                ) from None
            if (exc.code < 500 and exc.code != 429) or attempt == ATTEMPTS:
                raise FetchError(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            if attempt == ATTEMPTS:
                raise FetchError(f"{url}: {exc}") from None
        print(f"  retrying {url} in {delay:.0f}s", flush=True)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)
    raise FetchError(f"{url}: no answer")


def fetch_pool(
    dest: Path, name: str, repo: str, revision: str, endpoint: str, token: str | None
) -> None:
    out = dest / name
    marker = out / ".complete"
    want = f"{repo}@{revision}"
    if marker.exists() and marker.read_text().strip() == want:
        print(f"{name}: {want} already present", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    base = f"{endpoint.rstrip('/')}/{urllib.parse.quote(repo)}/resolve/{urllib.parse.quote(revision, safe='')}"
    for filename in REQUIRED + OPTIONAL:
        body = fetch(f"{base}/{filename}", token)
        if body is None:
            if filename in REQUIRED:
                raise FetchError(f"{name}: {repo}@{revision} has no {filename}")
            continue
        tmp = out / f".{filename}.part"
        tmp.write_bytes(body)
        tmp.replace(out / filename)
        print(f"{name}: {filename} ({len(body)} bytes) from {repo}@{revision}", flush=True)
    marker.write_text(want + "\n")


def parse_item(item: str) -> tuple[str, str, str]:
    name, sep, spec = item.partition("=")
    repo, _, revision = spec.partition("@")
    if not sep or not name or not repo or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAME=REPO@REVISION, got {item!r}")
    return name, repo, revision or "main"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", required=True, type=Path)
    ap.add_argument("pools", nargs="+", type=parse_item, metavar="NAME=REPO@REVISION")
    args = ap.parse_args(argv)
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    token = os.environ.get("HF_TOKEN") or None
    try:
        for name, repo, revision in args.pools:
            fetch_pool(args.dest, name, repo, revision, endpoint, token)
    except FetchError as exc:
        print(f"fetch_tokenizers: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
