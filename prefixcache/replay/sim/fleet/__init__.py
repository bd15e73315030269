"""The fleet replay: replicas behind the router (``simulator``), what the router reads of their
caches (``replica_trees``, ``index_feed``) and the pooled line it is measured against."""
