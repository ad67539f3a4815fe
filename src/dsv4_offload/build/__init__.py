"""Building the patched stack: the interpreter choice, cross builds for aarch64, the A3
bring-up steps, and the kt-kernel self-test (numpy reference and its child process)."""
