from fakestages import make

run = make("verify-gguf")
