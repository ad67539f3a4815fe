"""Proxies for our own clients: which are exported, and an environment that bypasses them
for the hosts we talk to directly (the server under test, a mirror on loopback).

The delivery's GPQA script sets `no_proxy` before its evaluator talks to 127.0.0.1
(gpqa_accuracy_repeat.sh); an exported `http_proxy` otherwise sends every round to a proxy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
              "ALL_PROXY")
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def exported(env: Mapping[str, str]) -> dict[str, str]:
    """The proxy variables set (non-empty) in ``env``."""
    return {k: env[k] for k in PROXY_VARS if env.get(k)}


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def bypassing(env: Mapping[str, str], hosts: Iterable[str]) -> dict[str, str]:
    """``env`` with ``hosts`` added to both `no_proxy` and `NO_PROXY` (kept, not replaced)."""
    out = dict(env)
    for var in ("no_proxy", "NO_PROXY"):
        have = [h.strip() for h in out.get(var, "").split(",") if h.strip()]
        out[var] = ",".join(have + [h for h in hosts if h and h not in have])
    return out


def hint(env: Mapping[str, str]) -> str:
    """A sentence naming the exported proxies (values without credentials), or ''."""
    found = exported(env)
    if not found:
        return ""
    shown = ", ".join(f"{k}={_no_credentials(v)}" for k, v in found.items())
    return (f"a proxy is exported ({shown}): the client goes through it unless the host is in "
            "no_proxy/NO_PROXY")


def _no_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return parts._replace(netloc=netloc).geturl()
    return url
