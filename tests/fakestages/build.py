from fakestages import make

run = make("build")
