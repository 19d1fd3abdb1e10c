"""The run: the core that drives the timing layer for one run (:mod:`~phase_timer.run.core`), the boundaries'
state machine that the doors report to (:mod:`~phase_timer.run.boundaries`), and phase-timer's own cost on sampled
steps (:mod:`~phase_timer.run.own_cost`).  The core hands each resolved window and step to the measures listening
(:mod:`phase_timer.measure`)."""
