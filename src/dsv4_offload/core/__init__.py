"""The shared base: errors, stage results, the stage registry, host probes, the clock and
the runner every external command goes through.

Nothing here imports from any other package of dsv4_offload."""
