from pipestages import standin

run = standin("doctor")
