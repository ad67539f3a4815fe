from fakestages import make

run = make("accept")
