"""The real verify-gguf stage (its run noted in ran.log first)."""

from dsv4_offload.stages import verify_gguf as real
from pipestages import noted

run = noted("verify-gguf", real.run)
fingerprint_inputs = real.fingerprint_inputs
