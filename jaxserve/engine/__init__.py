"""Host-side serving engine: sequences, page pool, scheduler, runner, the step loop."""
