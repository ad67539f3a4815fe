from pipestages import standin

run = standin("patch")
