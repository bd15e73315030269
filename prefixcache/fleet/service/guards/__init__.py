"""What keeps clients from taking the service: API keys (access) and per-key limits
(key_limits), requests in progress per client address (client_limits), connections within the
open-file limit (connection_budget) and each address's share of them (connection_shares), and a
log that counts what clients cause (quiet_log)."""
