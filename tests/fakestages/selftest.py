from fakestages import make

run = make("selftest")
