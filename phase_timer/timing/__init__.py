"""The timing layer: the clock, the engine (marks, records, their lazy resolution) and the window statistics.
It imports no measure, no output and no door."""
