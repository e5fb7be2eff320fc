"""Voice sessions (the OpenAI Realtime protocol): the driver that runs a session core
(`session/realtime/`) against its connections and the orchestrator, the session's live request,
the per-replica turn gate, and the host (store, admission, retention, resume) of voice sessions."""
