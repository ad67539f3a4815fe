from fakestages import make

run = make("serve")
