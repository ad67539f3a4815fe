from pipestages import standin

run = standin("selftest")
