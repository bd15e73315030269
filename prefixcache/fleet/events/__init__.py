"""KV events on the wire: the wire format, the publisher on a replica, and the subscriber that
feeds a fleet index (its stream intake, the event applier, the deferral of events waiting for a
shared index, and the replay client that fills gaps).
"""
