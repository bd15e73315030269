"""The manager's side of the tiers below the GPU: the host tier's offloads and loads, a shared
store's queries, loads and write-throughs, and the transfers both hand to the runtime."""
