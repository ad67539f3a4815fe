import os

from fakestages import make

run = make("build")


def fingerprint_inputs(ctx):  # type: ignore[no-untyped-def]
    """Differs inside the container, as the real build's tool versions do."""
    return {"where": "container" if os.environ.get("DSV4_IN_CONTAINER") else "host"}
