from fakestages import make

run = make("doctor")
