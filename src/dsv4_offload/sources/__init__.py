"""Pinned git sources and the patch series: fetch, apply, index-only check, carry and
rebase onto newer commits, and the audit of the log texts the tool expects."""
