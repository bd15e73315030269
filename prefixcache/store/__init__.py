"""Shared K/V stores, laid out as the fleet index is: the interface (``backend``), one module per
backend (``lmdb``: one host; ``mooncake``: Mooncake Store across hosts), opening one by URL
(``from_url``); and the block records (``block_record``) and the connector a runtime hands to
its ``CacheManager`` (``connector``)."""
