"""The loader service: coordinator, worker processes, sources, index builder (installed as entrain_data.workers)."""
