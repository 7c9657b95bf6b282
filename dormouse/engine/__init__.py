"""The workflow engine: configuration, the content-addressed store, the plan and its digests, provenance, retractions, experiments, result views and history, stage plumbing and transport."""
