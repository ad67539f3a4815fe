"""The real download stage (its run noted in ran.log first)."""

from dsv4_offload.stages import download as real
from pipestages import noted

run = noted("download", real.run)
