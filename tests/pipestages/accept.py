from pipestages import standin

run = standin("accept")
