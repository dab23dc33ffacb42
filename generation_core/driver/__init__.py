"""Driving a run: the run's sequence once, its dispatchers, progress, Ctrl-C, the console, `genrun bench`."""
