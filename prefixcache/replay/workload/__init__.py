"""Where replayed requests come from: scenario files, traces, token synthesis and arrival times."""
