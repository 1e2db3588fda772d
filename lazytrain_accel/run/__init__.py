"""A run's own state: setup from the config, the batch shape, the step guard and the re-planner."""
