"""Acceptance: HTTP probes of the server, the reference figures, and GPQA via evalscope."""
