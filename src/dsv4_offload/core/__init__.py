"""The shared base: errors, stage results, the stage registry and host probes.

Nothing here imports from any other package of dsv4_offload."""
