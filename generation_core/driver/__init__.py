"""Driving a run: the run's sequence once, its dispatchers, the finished-run answer, progress, the stall alarm, Ctrl-C and the watchdog, publishing."""
