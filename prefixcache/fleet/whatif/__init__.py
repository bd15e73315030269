"""What-if answers from live traffic: sampled miss-ratio curves of the prompts the service
routes (SHARDS), per replica and for the fleet as one cache, and a trace of what was routed
for the same questions offline."""
