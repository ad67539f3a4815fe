"""dsv4-offload: a resumable pipeline to a verified DeepSeek-V4-Flash NPU+CPU hybrid server."""

__version__ = "0.1.0"
