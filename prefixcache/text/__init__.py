"""Text into token ids, shared by the replay and the fleet service: tokenizers and chat
templates."""
