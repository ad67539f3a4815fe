from fakestages import make

run = make("patch")
