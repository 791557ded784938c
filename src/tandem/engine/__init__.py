"""Real-time glue: owns the wall clock, calls the scheduler (policy) and the executor; decides nothing."""
