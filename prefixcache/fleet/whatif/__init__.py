"""What-if answers from live traffic: sampled miss-ratio curves of the prompts the service
routes (SHARDS), per replica and for the fleet as one cache; a trace of what was routed; and
other fleets (replica counts, policies) answered by replaying that trace off the route path."""
