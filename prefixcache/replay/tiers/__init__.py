"""Memory tiers below the GPU cache of a replay: the host tier's settings, the shared pool and
admissions through the tiers.
"""
