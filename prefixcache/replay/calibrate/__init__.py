"""GPU profiles for the serving simulation: measure a GPU, fit the roofline, read and write
profiles.
"""
