"""What keeps one client from taking the service: API keys (access) and per-key limits
(key_limits), requests in progress per client address (client_limits), connections within the
open-file limit (connection_budget), and a log that counts what clients cause (quiet_log)."""
