"""The self-contained run report: its data, plots, trajectory viewer and HTML."""
