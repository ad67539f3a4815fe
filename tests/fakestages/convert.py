from fakestages import make

run = make("convert")
