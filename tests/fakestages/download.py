from fakestages import make

run = make("download")
