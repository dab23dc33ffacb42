"""Benchmarks and the instruments they need (bench/sim: the simulated engine); not part of the product."""
