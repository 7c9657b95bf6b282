"""The planner: presets and experiments resolved into stage jobs and their digests (registry, plan), the job a stage runs (job), retractions and transport of artifacts."""
