"""Where values go: the sinks (our event file, a user's writer, loggers and callables), every sink's tags, the
printed table, the run summary file and the trace."""
