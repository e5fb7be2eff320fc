"""Robot policy sessions: the OpenPI wire (and vLLM-Omni's additions) on the session layer."""
