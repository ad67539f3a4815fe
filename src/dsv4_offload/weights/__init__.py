"""Model weights: hub downloads, the native MXFP4 checkpoint, GGUF writing and reading."""
