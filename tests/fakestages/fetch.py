from fakestages import make

run = make("fetch")
