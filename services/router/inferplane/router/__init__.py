"""inferplane.router: InferenceService for the edge and internal callers."""
