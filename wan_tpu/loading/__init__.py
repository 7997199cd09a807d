"""Checkpoint reading, parameter placement and stacking, model ids, seeded random weights, Wan parameter names."""
