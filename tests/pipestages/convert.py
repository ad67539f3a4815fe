"""The real convert stage (its run noted in ran.log first); it follows a running download."""

from dsv4_offload.stages import convert as real
from pipestages import noted

run = noted("convert", real.run)
fingerprint_inputs = real.fingerprint_inputs
FOLLOWS = real.FOLLOWS
