"""dagfold's services: one folder per process kind (scheduler, allocator, worker, agent, api)."""
