from pipestages import standin

run = standin("fetch")
