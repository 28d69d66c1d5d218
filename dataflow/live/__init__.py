"""The live run: producers, consumers, backpressure, metrics and collectives."""
