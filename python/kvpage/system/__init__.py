"""The process around the engine: huge pages, the garbage collector, the compilation
cache, and which optional extras are installed."""
