from fakestages import make

run = make("convert")
FOLLOWS = True  # it may start beside download (the real one converts layers as shards land)
