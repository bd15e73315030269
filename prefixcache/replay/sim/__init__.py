"""The simulations a replay runs over the real cache manager: sequential, serving and fleet, with
their hit accounting.
"""
